"""The plan as a kustomize overlay: what the planner decided is what runs.

`overlay(plan, row, target)` renders three files for the chosen row (pure, text out), a kustomize
Component: the production kustomization lists it under `components:` and its patches apply to
the worker and autoscaler Deployments there (deploy/k8s/plan is the shipped one).

- `kustomization.yaml`: the patches, and the plan's arithmetic as a comment;
- `worker-patch.yaml`: the engine's arguments (precision, TP, chunked prefill, speculative
  decoding, LoRA slots, the pinned model revision), its GPUs, and standby workers (the warm pool:
  new pods load their engine and wait until the autoscaler promotes them);
- `autoscaler-patch.yaml`: the per-replica goodput, headroom, SLO, serving and warm-pool bounds
  and the GPU budget, all from the plan.

The engine's arguments replace the base's list whole (a strategic merge replaces lists of
strings), so the arguments every inferbus engine needs are rendered here too (`COMMON_ENGINE_ARGS`).

A disaggregated plan (`disaggregated_overlay`) deploys two pools. The base `worker` Deployment
becomes the decode pool (its engine `--disaggregation-mode decode` at the decode TP, its worker
INFERBUS_WORKER_ROLE=decode) and `worker-prefill.yaml` adds the prefill pool: a copy of the base
worker Deployment (read from the base manifest, so the two pods differ only where the plan says)
with the prefill TP, `--disaggregation-mode prefill`, its bootstrap port and
INFERBUS_WORKER_ROLE=prefill. The pools' pods keep `app.kubernetes.io/name: worker` (the network
policies admit them) and tell their Deployments apart by `inferbus.io/role`; the autoscaler sizes
each pool on its own signal with the plan's per-pool goodputs and bounds, and its Role may scale both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from tools.capacity.plan.disagg import DisaggRow
from tools.capacity.plan.planner import Plan, Row, fleet_terms, zone_factor
from tools.capacity.plan.sizing import PooledGoodputs

# The model revision is a commit of the model repository (a branch or tag can move under a running
# fleet). Without one on the command line the engine reads it from the ConfigMap `model-revision`,
# which the operator creates; the pod does not start until it exists.
COMMIT = re.compile(r"^[0-9a-f]{40}$")
REVISION_CONFIGMAP = "model-revision"

# Arguments every inferbus engine runs with, whatever the plan (see deploy/k8s/worker.yaml).
COMMON_ENGINE_ARGS = (
    "--host", "0.0.0.0",
    "--port", "30000",
    "--enable-metrics",
    "--enable-priority-scheduling",
    # Forced JSON (response_format, forced tool calls) without the whitespace SGLang's default
    # grammar allows between tokens, which a model can fill max_tokens with.
    "--constrained-json-disable-any-whitespace",
    "--page-size", "64",
    "--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}',
)
KV_CACHE_DTYPE = {"fp8": "fp8_e4m3", "bf16": "auto"}
# Disaggregated pools: the label that tells the two worker Deployments' pods apart, the prefill
# pool's Deployment, and SGLang's default bootstrap port (services/worker/roles.py).
ROLE_LABEL = "inferbus.io/role"
PREFILL_DEPLOYMENT = "worker-prefill"
BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class DeployTarget:
    """What the plan does not decide: where the overlay points and what it runs."""

    model: str
    command: str  # the `inferbus plan` command line, for the header
    revision: str | None = None  # a commit; None: from the ConfigMap
    draft_model: str | None = None  # speculative decoding's draft model (needed when the row uses it)

    def __post_init__(self) -> None:
        if self.revision is not None and not COMMIT.match(self.revision):
            raise ValueError(f"the model revision must be a 40-hex commit, got {self.revision!r}")


def engine_args(plan: Plan, row: Row, target: DeployTarget) -> list[str]:
    return _engine_args(plan, row.tp, row.spec_on, row.name, target)


def _engine_args(plan: Plan, tp: int, spec_on: bool, name: str, target: DeployTarget,
                 role_args: tuple[str, ...] = ()) -> list[str]:
    i = plan.inputs
    args = ["--model-path", target.model,
            "--revision", target.revision or "$(MODEL_REVISION)",
            "--tp", str(tp)]
    if i.weights == "fp8":
        args += ["--quantization", "fp8"]
    args += ["--kv-cache-dtype", KV_CACHE_DTYPE[i.kv_cache],
             "--chunked-prefill-size", str(i.assumptions.chunk_tokens)]
    if spec_on and i.spec is not None:
        if target.draft_model is None:
            raise ValueError(f"{name} runs speculative decoding: give its draft model (--spec-draft-model)")
        k = i.spec.draft_tokens
        args += ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", target.draft_model,
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
    args += ["--enable-lora", "--max-loras-per-batch", str(i.lora_slots), "--max-lora-rank", str(i.lora_rank),
             "--lora-target-modules", "all"]
    return args + list(role_args) + list(COMMON_ENGINE_ARGS)


def _rps(value: float) -> str:
    return f"{math.floor(value * 1000) / 1000:g}"


def _by_serving(name: str, pooled: PooledGoodputs | None) -> list[tuple[str, str]]:
    """The pooled goodput by replicas serving, where it varies (where TPOT or KV binds at every
    size, the one goodput says it all)."""
    table = pooled.table() if pooled is not None else ()
    return [(name, ",".join(f"{n}:{_rps(goodput)}" for n, goodput in table))] if len(table) > 1 else []


def autoscaler_env(plan: Plan, row: Row) -> list[tuple[str, str]]:
    i = plan.inputs
    # The autoscaler's one headroom number carries the zone spare too: (1 + h) × Z ÷ (Z − 1) − 1.
    headroom = (1 + i.headroom) * zone_factor(i.zones) - 1
    return [
        ("INFERBUS_AUTOSCALER_GOODPUT_RPS", _rps(row.goodput_rps)),
        *_by_serving("INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING", row.pooled),
        ("INFERBUS_AUTOSCALER_HEADROOM", f"{headroom:.4g}"),
        ("INFERBUS_AUTOSCALER_TTFT_SLO_S", f"{i.slo.ttft_p90_s:g}"),
        ("INFERBUS_AUTOSCALER_TPOT_SLO_S", f"{i.slo.tpot_p90_s:g}"),
        ("INFERBUS_AUTOSCALER_MIN_SERVING", str(max(2, i.zones))),
        ("INFERBUS_AUTOSCALER_MAX_SERVING", str(row.replicas)),
        ("INFERBUS_AUTOSCALER_MIN_WARM", "0"),
        ("INFERBUS_AUTOSCALER_MAX_WARM", str(row.warm_replicas)),
        # The GPU budget is what the plan priced: serving (headroom included) plus the warm pool.
        ("INFERBUS_AUTOSCALER_MAX_REPLICAS", str(row.replicas + row.warm_replicas)),
        ("INFERBUS_AUTOSCALER_COLD_START_S", f"{i.cold_start_s:g}"),
        ("INFERBUS_AUTOSCALER_WARM_START_S", f"{i.warm_start_s:g}"),
    ]


def _quote(value: str) -> str:
    """A YAML double-quoted scalar."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _arithmetic(plan: Plan, row: Row) -> list[str]:
    i, c = plan.inputs, row.cost
    assert c is not None
    spec = ""
    if row.spec_on and i.spec is not None:
        spec = (f", speculative decoding k={i.spec.draft_tokens} α={i.spec.acceptance:g} "
                f"(E={i.spec.tokens_per_step:.2f} tokens per step)")
    lines = [
        f"peak {i.rate_rps:,.1f} req/s of mix {i.mix.get('name')}; SLO p90 TTFT <= {i.slo.ttft_p90_s * 1e3:g} ms, "
        f"TPOT <= {i.slo.tpot_p90_s * 1e3:g} ms",
        f"engine: {row.gpu} TP{row.tp}, {i.weights.upper()} weights, {i.kv_cache.upper()} KV cache{spec}, "
        f"chunk {i.assumptions.chunk_tokens:,}, {i.lora_slots} LoRA slots",
        f"goodput per replica {row.goodput_rps:.3f} req/s ({row.source}; {row.binding} binds)",
        f"serving replicas = {_ascii(fleet_terms(i).arithmetic(row.goodput_rps, row.sizing))}",
    ]
    if row.warm is not None:
        w = row.warm
        lines.append(f"warm pool = ceil({w.ramp_rps_per_s:.3f} req/s per s x {w.cold_start_s:g} s / "
                     f"{row.goodput_rps:.3f}) = {w.replicas}")
    else:
        lines.append("warm pool = 0 (no ramp given)")
    lines += [
        f"GPUs = ({row.replicas} + {row.warm_replicas}) x {row.tp} = {row.gpus_total}",
        f"cost = {row.gpus_total} x ${row.usd_per_gpu_hour:.2f} = ${c.usd_per_hour:,.2f}/hour; "
        f"${c.usd_per_1m_output_all_in:.3f} per 1M output tokens all-in",
    ]
    return lines


def _generated_header(target: DeployTarget, arithmetic: list[str]) -> list[str]:
    """The comment every generated overlay file starts with: how to regenerate it, and the plan's arithmetic."""
    return [
        "# Generated by `inferbus plan`: edit the plan, not this file, and regenerate it with",
        f"#   {target.command}",
        "# (a test fails when the shipped overlay and the command's output differ).",
        "#",
        *[f"# {line}" for line in arithmetic],
    ]


def _revision_env(target: DeployTarget) -> str:
    """The worker's MODEL_REVISION from the revision ConfigMap, unless the target pins one."""
    return "" if target.revision else (
        "          env:\n"
        "            - name: MODEL_REVISION              # the pinned commit: kubectl create configmap "
        f"{REVISION_CONFIGMAP} --from-literal=revision=<commit>\n"
        "              valueFrom:\n"
        "                configMapKeyRef:\n"
        f"                  name: {REVISION_CONFIGMAP}\n"
        "                  key: revision\n")


def _autoscaler_patch(comment: str, env: Iterable[tuple[str, str]]) -> str:
    """The autoscaler Deployment patch that sets `env` (the plan's bounds), under `comment`."""
    lines = "\n".join(f"            - name: {name}\n              value: {_quote(value)}" for name, value in env)
    return (
        comment
        + "apiVersion: apps/v1\n"
        "kind: Deployment\n"
        "metadata:\n"
        "  name: autoscaler\n"
        "  namespace: inferbus\n"
        "spec:\n"
        "  template:\n"
        "    spec:\n"
        "      containers:\n"
        "        - name: autoscaler\n"
        "          env:\n"
        f"{lines}\n"
    )


def overlay(plan: Plan, row: Row, target: DeployTarget) -> dict[str, str]:
    """File name → text of the overlay for `row` of `plan`."""
    if not row.feasible or row.cost is None:
        raise ValueError(f"{row.name} is infeasible: nothing to deploy")
    header = _generated_header(target, _arithmetic(plan, row))
    kustomization = [
        *header,
        "apiVersion: kustomize.config.k8s.io/v1alpha1",
        "kind: Component",
        "patches:",
        "  - path: worker-patch.yaml",
        "  - path: autoscaler-patch.yaml",
        "",
    ]
    args = "\n".join(f"            - {_quote(a)}" for a in engine_args(plan, row, target))
    revision_env = _revision_env(target)
    worker = (
        "# The engine the plan chose, and standby workers: a new pod loads its engine and waits until the\n"
        "# autoscaler promotes it (the warm pool).\n"
        "apiVersion: apps/v1\n"
        "kind: Deployment\n"
        "metadata:\n"
        "  name: worker\n"
        "  namespace: inferbus\n"
        "spec:\n"
        "  template:\n"
        "    spec:\n"
        "      initContainers:\n"
        "        - name: zone                    # unchanged, named to keep it first: the node's zone, then the "
        "engine\n        - name: sglang\n"
        "          args:\n"
        f"{args}\n"
        f"{revision_env}"
        "          resources:\n"
        "            limits:\n"
        f"              nvidia.com/gpu: {row.tp}\n"
        "      containers:\n"
        "        - name: worker\n"
        "          env:\n"
        "            - name: INFERBUS_WORKER_STANDBY\n"
        '              value: "true"\n'
    )
    autoscaler = _autoscaler_patch(
        "# Autoscaler bounds from the plan: serving replicas up to the planned peak (headroom included),\n"
        "# a warm pool up to the plan's, and no more replicas than the plan priced.\n",
        autoscaler_env(plan, row))
    return {"kustomization.yaml": "\n".join(kustomization), "worker-patch.yaml": worker,
            "autoscaler-patch.yaml": autoscaler}


# ---- a disaggregated plan: a prefill pool and a decode pool -----------------------------------


def _warm(pool: Any) -> int:
    return pool.replicas if pool is not None else 0


def disaggregated_engine_args(plan: Plan, row: DisaggRow, role: str, target: DeployTarget) -> list[str]:
    """The engine of one pool: the plan's precision, chunk and LoRA, the pool's TP and SGLang's PD mode."""
    tp = row.tp_prefill if role == "prefill" else row.tp_decode
    mode = ["--disaggregation-mode", role]
    if role == "prefill":
        mode += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    return _engine_args(plan, tp, False, f"{row.name} ({role})", target, tuple(mode))


def disaggregated_autoscaler_env(plan: Plan, row: DisaggRow) -> list[tuple[str, str]]:
    """Both pools' bounds: the decode pool on the autoscaler's own settings (the `worker`
    Deployment), the prefill pool on its PREFILL_ ones; each pool's GPU budget is what the plan
    priced for it (serving, headroom included, plus its warm pool)."""
    i = plan.inputs
    headroom = (1 + i.headroom) * zone_factor(i.zones) - 1
    floor = str(max(2, i.zones))

    warm_p, warm_d = _warm(row.prefill_warm), _warm(row.decode_warm)
    return [
        ("INFERBUS_AUTOSCALER_DISAGGREGATED", "true"),
        ("INFERBUS_AUTOSCALER_K8S_PREFILL_DEPLOYMENTS", PREFILL_DEPLOYMENT),
        ("INFERBUS_AUTOSCALER_HEADROOM", f"{headroom:.4g}"),
        ("INFERBUS_AUTOSCALER_TTFT_SLO_S", f"{i.slo.ttft_p90_s:g}"),
        ("INFERBUS_AUTOSCALER_TPOT_SLO_S", f"{i.slo.tpot_p90_s:g}"),
        ("INFERBUS_AUTOSCALER_MIN_SERVING", floor),
        ("INFERBUS_AUTOSCALER_COLD_START_S", f"{i.cold_start_s:g}"),
        ("INFERBUS_AUTOSCALER_WARM_START_S", f"{i.warm_start_s:g}"),
        # decode: TPOT and KV room
        ("INFERBUS_AUTOSCALER_GOODPUT_RPS", _rps(row.decode_rps)),
        ("INFERBUS_AUTOSCALER_DECODE_KV_BUDGET", f"{i.assumptions.kv_limit:g}"),
        ("INFERBUS_AUTOSCALER_MAX_SERVING", str(row.decode_replicas)),
        ("INFERBUS_AUTOSCALER_MIN_WARM", "0"),
        ("INFERBUS_AUTOSCALER_MAX_WARM", str(warm_d)),
        ("INFERBUS_AUTOSCALER_MAX_REPLICAS", str(row.decode_replicas + warm_d)),
        # prefill: its share of the TTFT budget and its queue. Its workers measure a decode worker's ask → KV sent,
        # so the budget is the prefill's share plus the transfer (the SLO less the decode steps).
        ("INFERBUS_AUTOSCALER_PREFILL_GOODPUT_RPS", _rps(row.prefill_rps)),
        *_by_serving("INFERBUS_AUTOSCALER_PREFILL_GOODPUT_BY_SERVING", row.prefill_pooled),
        ("INFERBUS_AUTOSCALER_PREFILL_TTFT_BUDGET_S", f"{row.prefill_budget_s + row.transfer_p90_s:.4g}"),
        ("INFERBUS_AUTOSCALER_PREFILL_MAX_SERVING", str(row.prefill_replicas)),
        ("INFERBUS_AUTOSCALER_PREFILL_MAX_WARM", str(warm_p)),
        ("INFERBUS_AUTOSCALER_PREFILL_MAX_REPLICAS", str(row.prefill_replicas + warm_p)),
    ]


def _disaggregated_arithmetic(plan: Plan, row: DisaggRow) -> list[str]:
    i = plan.inputs
    lines = [
        f"peak {i.rate_rps:,.1f} req/s of mix {i.mix.get('name')}; SLO p90 TTFT <= {i.slo.ttft_p90_s * 1e3:g} ms, "
        f"TPOT <= {i.slo.tpot_p90_s * 1e3:g} ms",
        f"disaggregated: {row.name}, {i.weights.upper()} weights, {i.kv_cache.upper()} KV cache, "
        f"chunk {i.assumptions.chunk_tokens:,}, {i.lora_slots} LoRA slots; KV over {row.link.name}",
        f"TTFT budget: prefill {row.prefill_budget_s * 1e3:,.0f} ms after {row.transfer_p90_s * 1e3:,.0f} ms of "
        f"transfer and {row.decode_steps_s * 1e3:,.0f} ms of decode steps",
    ]
    terms = fleet_terms(i)
    for role, rps, replicas, tp, warm, sizing in (
            ("prefill", row.prefill_rps, row.prefill_replicas, row.tp_prefill, row.prefill_warm, row.prefill_sizing),
            ("decode", row.decode_rps, row.decode_replicas, row.tp_decode, row.decode_warm, row.decode_sizing)):
        lines.append(
            f"{role}: goodput per replica {rps:.3f} req/s; serving replicas = {_ascii(terms.arithmetic(rps, sizing))}; "
            f"warm pool {_warm(warm)}; GPUs = ({replicas} + {_warm(warm)}) x {tp} = {(replicas + _warm(warm)) * tp}"
        )
    lines += [
        f"P:D GPUs {row.ratio}; GPUs = {row.gpus_total}",
        f"cost = {row.gpus_total} x ${row.usd_per_gpu_hour:.2f} = ${row.usd_per_hour:,.2f}/hour",
    ]
    return lines


def _ascii(arithmetic: str) -> str:
    """The report's sizing rule in the ASCII the manifests' comments are written in."""
    for wide, plain in (("⌈", "ceil("), ("⌉", ")"), ("÷", "/"), ("×", "x")):
        arithmetic = arithmetic.replace(wide, plain)
    return arithmetic


def _base_deployment(worker_manifest: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all(worker_manifest):
        if doc and doc.get("kind") == "Deployment" and doc.get("metadata", {}).get("name") == "worker":
            return doc
    raise ValueError("the base worker manifest holds no Deployment named worker")


def _env_set(env: list[dict[str, Any]], name: str, value: str) -> None:
    for item in env:
        if item.get("name") == name:
            item.clear()
            item.update(name=name, value=value)
            return
    env.append({"name": name, "value": value})


def _prefill_deployment(plan: Plan, row: DisaggRow, target: DeployTarget, worker_manifest: str) -> dict[str, Any]:
    """The base worker Deployment as the prefill pool: renamed, told apart by the role label, the
    prefill engine, its GPUs and standby workers of role prefill."""
    d = _base_deployment(worker_manifest)
    d["metadata"]["name"] = PREFILL_DEPLOYMENT
    d["metadata"].setdefault("labels", {})[ROLE_LABEL] = "prefill"
    spec = d["spec"]
    spec.pop("replicas", None)  # the autoscaler owns it
    spec["selector"]["matchLabels"][ROLE_LABEL] = "prefill"
    spec["template"]["metadata"]["labels"][ROLE_LABEL] = "prefill"
    pod = spec["template"]["spec"]
    for constraint in pod.get("topologySpreadConstraints", []):
        constraint["labelSelector"]["matchLabels"][ROLE_LABEL] = "prefill"
    [engine] = [c for c in pod["initContainers"] if c["name"] == "sglang"]
    engine["args"] = disaggregated_engine_args(plan, row, "prefill", target)
    engine["resources"]["limits"]["nvidia.com/gpu"] = row.tp_prefill
    ports = engine.setdefault("ports", [])
    if not any(p.get("containerPort") == BOOTSTRAP_PORT for p in ports):
        ports.append({"name": "bootstrap", "containerPort": BOOTSTRAP_PORT})
    if not target.revision:
        env = engine.setdefault("env", [])
        env[:] = [e for e in env if e.get("name") != "MODEL_REVISION"]
        env.append(
            {
                "name": "MODEL_REVISION",
                "valueFrom": {"configMapKeyRef": {"name": REVISION_CONFIGMAP, "key": "revision"}},
            }
        )
    [worker] = [c for c in pod["containers"] if c["name"] == "worker"]
    _env_set(worker.setdefault("env", []), "INFERBUS_WORKER_STANDBY", "true")
    _env_set(worker["env"], "INFERBUS_WORKER_ROLE", "prefill")
    return d


def disaggregated_overlay(plan: Plan, row: DisaggRow, target: DeployTarget, worker_manifest: str) -> dict[str, str]:
    """File name → text of the overlay for the disaggregated pair `row` of `plan`; `worker_manifest`
    is the base worker manifest (deploy/k8s/worker.yaml), the prefill pool's template."""
    if not row.feasible:
        raise ValueError(f"{row.name} is infeasible: nothing to deploy")
    header = _generated_header(target, _disaggregated_arithmetic(plan, row))
    kustomization = [
        *header,
        "apiVersion: kustomize.config.k8s.io/v1alpha1",
        "kind: Component",
        "resources:",
        "  - worker-prefill.yaml",
        "patches:",
        "  - path: worker-patch.yaml",
        "  - path: worker-pdb-patch.yaml",
        "  - path: autoscaler-patch.yaml",
        "  - path: autoscaler-role-patch.yaml",
        "",
    ]
    args = "\n".join(f"            - {_quote(a)}" for a in disaggregated_engine_args(plan, row, "decode", target))
    revision_env = _revision_env(target)
    decode = (
        "# The decode pool: the base worker Deployment with the plan's decode engine (SGLang\n"
        f"# --disaggregation-mode decode) and standby workers of role decode; its pods carry {ROLE_LABEL}: decode,\n"
        f"# which keeps them apart from the prefill pool's ({PREFILL_DEPLOYMENT}). The selector changes: an\n"
        "# aggregated worker Deployment already running is deleted before this one is applied.\n"
        "apiVersion: apps/v1\n"
        "kind: Deployment\n"
        "metadata:\n"
        "  name: worker\n"
        "  namespace: inferbus\n"
        "  labels:\n"
        f"    {ROLE_LABEL}: decode\n"
        "spec:\n"
        "  selector:\n"
        "    matchLabels:\n"
        f"      {ROLE_LABEL}: decode\n"
        "  template:\n"
        "    metadata:\n"
        "      labels:\n"
        f"        {ROLE_LABEL}: decode\n"
        "    spec:\n"
        "      topologySpreadConstraints:\n"
        "        - topologyKey: topology.kubernetes.io/zone\n"
        "          whenUnsatisfiable: DoNotSchedule\n"
        "          labelSelector:\n"
        "            matchLabels:\n"
        f"              {ROLE_LABEL}: decode\n"
        "      initContainers:\n"
        "        - name: zone                    # unchanged, named to keep it first: the node's zone, then the "
        "engine\n        - name: sglang\n"
        "          args:\n"
        f"{args}\n"
        f"{revision_env}"
        "          resources:\n"
        "            limits:\n"
        f"              nvidia.com/gpu: {row.tp_decode}\n"
        "      containers:\n"
        "        - name: worker\n"
        "          env:\n"
        "            - name: INFERBUS_WORKER_STANDBY\n"
        '              value: "true"\n'
        "            - name: INFERBUS_WORKER_ROLE\n"
        "              value: decode\n"
    )
    prefill = _prefill_deployment(plan, row, target, worker_manifest)
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": {"name": PREFILL_DEPLOYMENT, "namespace": "inferbus",
                        "labels": {"app.kubernetes.io/name": "worker", "app.kubernetes.io/part-of": "inferbus",
                                   ROLE_LABEL: "prefill"}},
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(prefill["spec"]["selector"]["matchLabels"])}}}
    prefill_text = (
        "# The prefill pool: the base worker Deployment (deploy/k8s/worker.yaml) with the plan's prefill\n"
        "# engine (SGLang --disaggregation-mode prefill, its bootstrap server on port "
        f"{BOOTSTRAP_PORT}) and standby workers of\n"
        "# role prefill. The autoscaler owns its replicas.\n"
        + yaml.safe_dump(prefill, sort_keys=False, width=1000) + "---\n"
        + yaml.safe_dump(pdb, sort_keys=False, width=1000))
    autoscaler = _autoscaler_patch(
        "# Autoscaler bounds from the plan, one set per pool: the decode pool (worker) sized on TPOT and KV\n"
        f"# use, the prefill pool ({PREFILL_DEPLOYMENT}) on its share of the TTFT budget and its queue, and\n"
        "# no more replicas in either than the plan priced.\n",
        disaggregated_autoscaler_env(plan, row))
    role = (
        "# The autoscaler may scale both pools' Deployments (and nothing else).\n"
        "apiVersion: rbac.authorization.k8s.io/v1\n"
        "kind: Role\n"
        "metadata:\n"
        "  name: autoscaler\n"
        "  namespace: inferbus\n"
        "rules:\n"
        '  - apiGroups: ["apps"]\n'
        '    resources: ["deployments/scale"]\n'
        f'    resourceNames: ["worker", "{PREFILL_DEPLOYMENT}"]\n'
        '    verbs: ["get", "patch"]\n'
    )
    pdb_patch = (
        "# The base disruption budget covers the decode pool alone: a pod that two budgets select cannot be\n"
        f"# evicted at all, and {PREFILL_DEPLOYMENT} has its own.\n"
        "apiVersion: policy/v1\n"
        "kind: PodDisruptionBudget\n"
        "metadata:\n"
        "  name: worker\n"
        "  namespace: inferbus\n"
        "spec:\n"
        "  selector:\n"
        "    matchLabels:\n"
        f"      {ROLE_LABEL}: decode\n"
    )
    return {
        "kustomization.yaml": "\n".join(kustomization),
        "worker-patch.yaml": decode,
        "worker-pdb-patch.yaml": pdb_patch,
        "worker-prefill.yaml": prefill_text,
        "autoscaler-patch.yaml": autoscaler,
        "autoscaler-role-patch.yaml": role,
    }
