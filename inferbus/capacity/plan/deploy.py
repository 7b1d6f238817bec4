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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from inferbus.capacity.plan.planner import Plan, Row, zone_factor

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
    i = plan.inputs
    args = ["--model-path", target.model,
            "--revision", target.revision or "$(MODEL_REVISION)",
            "--tp", str(row.tp)]
    if i.weights == "fp8":
        args += ["--quantization", "fp8"]
    args += ["--kv-cache-dtype", KV_CACHE_DTYPE[i.kv_cache],
             "--chunked-prefill-size", str(i.assumptions.chunk_tokens)]
    if row.spec_on and i.spec is not None:
        if target.draft_model is None:
            raise ValueError(f"{row.name} runs speculative decoding: give its draft model (--spec-draft-model)")
        k = i.spec.draft_tokens
        args += ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", target.draft_model,
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
    args += ["--enable-lora", "--max-loras-per-batch", str(i.lora_slots), "--max-lora-rank", str(i.lora_rank),
             "--lora-target-modules", "all"]
    return args + list(COMMON_ENGINE_ARGS)


def autoscaler_env(plan: Plan, row: Row) -> list[tuple[str, str]]:
    i = plan.inputs
    # The autoscaler's one headroom number carries the zone spare too: (1 + h) × Z ÷ (Z − 1) − 1.
    headroom = (1 + i.headroom) * zone_factor(i.zones) - 1
    return [
        ("INFERBUS_AUTOSCALER_GOODPUT_RPS", f"{math.floor(row.goodput_rps * 1000) / 1000:g}"),
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
    zones = f" × {i.zones}/{i.zones - 1} (one zone lost)" if i.zones > 1 else ""
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
        f"serving replicas = ceil({i.rate_rps:.2f} / {row.goodput_rps:.3f} x {1 + i.headroom:g}{zones}) = {row.replicas}",
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


def overlay(plan: Plan, row: Row, target: DeployTarget) -> dict[str, str]:
    """File name → text of the overlay for `row` of `plan`."""
    if not row.feasible or row.cost is None:
        raise ValueError(f"{row.name} is infeasible: nothing to deploy")
    header = [
        "# Generated by `inferbus plan`: edit the plan, not this file, and regenerate it with",
        f"#   {target.command}",
        "# (a test fails when the shipped overlay and the command's output differ).",
        "#",
        *[f"# {line}" for line in _arithmetic(plan, row)],
    ]
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
    revision_env = "" if target.revision else (
        "          env:\n"
        "            - name: MODEL_REVISION              # the pinned commit: kubectl create configmap "
        f"{REVISION_CONFIGMAP} --from-literal=revision=<commit>\n"
        "              valueFrom:\n"
        "                configMapKeyRef:\n"
        f"                  name: {REVISION_CONFIGMAP}\n"
        "                  key: revision\n")
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
        "        - name: zone                    # unchanged, named to keep it first: the node's zone, then the engine\n"
        "        - name: sglang\n"
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
    env = "\n".join(f"            - name: {name}\n              value: {_quote(value)}"
                    for name, value in autoscaler_env(plan, row))
    autoscaler = (
        "# Autoscaler bounds from the plan: serving replicas up to the planned peak (headroom included),\n"
        "# a warm pool up to the plan's, and no more replicas than the plan priced.\n"
        "apiVersion: apps/v1\n"
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
        f"{env}\n"
    )
    return {"kustomization.yaml": "\n".join(kustomization), "worker-patch.yaml": worker,
            "autoscaler-patch.yaml": autoscaler}
