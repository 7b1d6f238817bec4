"""Offline checks for the deployment artifacts: compose, Kubernetes, Prometheus, Grafana.

Nothing here needs Docker, a cluster or network. Tools that are optional on a developer
machine (kubectl for kustomize rendering, promtool for PromQL parsing) are used when
present and the corresponding test is skipped with a reason otherwise; with
INFERBUS_REQUIRE_PROMTOOL set (as `.ci/run` does), a missing promtool fails the PromQL checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = Path(__file__).resolve().parent / "schemas"  # with their sources in its README
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "inferbus-overview.json"
BILLING_DASHBOARD = DEPLOY / "grafana" / "inferbus-billing.json"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
COMPOSE = REPO / "docker-compose.yml"

# Oldest Kubernetes we support: native sidecars (initContainers with restartPolicy: Always)
# are on by default from 1.29; kubernetes-validate bundles schemas from 1.25 on.
K8S_VERSION = "1.30.0"

# The metrics contract: every inferbus_* name a rule or panel uses must be one the services
# export. Change this list together with the code that exports the metric.
HISTOGRAMS = {
    "inferbus_ttft_seconds",
    "inferbus_tpot_seconds",
    "inferbus_e2e_seconds",
    "inferbus_queue_wait_seconds",
    "inferbus_billing_batch_seconds",
    "inferbus_adapter_ttft_seconds",  # {adapter: the busiest by name, the rest `other`}
    "inferbus_adapter_load_seconds",
}
BILLING_METRICS = {  # services/billing/metrics.py
    "inferbus_billing_tokens_total",  # {tenant, model, kind=input|cached_input|output}
    "inferbus_billing_dollars_total",  # {tenant, model}
    "inferbus_billing_events_total",  # {result=counted|duplicate|invalid}
    "inferbus_billing_batches_total",
    "inferbus_billing_ledger_pending_events",
    "inferbus_billing_ledger_lag_seconds",
    "inferbus_billing_exports_total",  # {result}
}
METRICS = HISTOGRAMS | {
    # gateway
    "inferbus_requests_total",  # {endpoint, status}
    "inferbus_tokens_total",  # {kind=prompt|completion|cached}
    "inferbus_inflight_requests",
    "inferbus_migrations_total",
    "inferbus_errors_total",  # {type}
    # worker
    "inferbus_worker_running_requests",
    "inferbus_worker_free_slots",
    "inferbus_worker_kv_usage_ratio",
    "inferbus_worker_requests_total",  # {status}
    "inferbus_worker_engine_errors_total",
    # LoRA adapters: gateway (services/gateway/adapter_metrics.py), worker (services/worker/adapters.py)
    "inferbus_adapter_requests_total",  # {adapter}
    "inferbus_adapter_loads_total",  # {result}
    "inferbus_adapter_evictions_total",  # {reason}
    "inferbus_adapters_loaded",
} | BILLING_METRICS
ENGINE_METRICS = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
}

_INFERBUS_NAME = re.compile(r"\binferbus_[a-zA-Z0-9_]+")
_SGLANG_NAME = re.compile(r"\bsglang:[a-zA-Z0-9_]+")
_RECORDED_NAME = re.compile(r"\binferbus:[a-zA-Z0-9_:]+")


# ---------------------------------------------------------------- helpers


def _unknown_metrics(expr: str) -> set[str]:
    """inferbus_* / sglang:* names in `expr` that are not in the contract."""
    unknown = set()
    for name in _INFERBUS_NAME.findall(expr):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in METRICS or (base in HISTOGRAMS and base != name):
            continue
        unknown.add(name)
    for name in _SGLANG_NAME.findall(expr):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in ENGINE_METRICS and base not in ENGINE_METRICS:
            unknown.add(name)
    return unknown


def _load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s_manifest_files() -> list[Path]:
    # Patches (`*-patch.yaml`, in the plan's kustomize Component) are partial objects, not manifests.
    return sorted(
        p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and not p.name.endswith("-patch.yaml")
    )


def _kustomization_dirs() -> list[Path]:
    """Kustomizations with resources of their own (Components only patch their parent's)."""
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml")
                  if yaml.safe_load(p.read_text()).get("kind", "Kustomization") == "Kustomization")


def _validate_k8s(doc: dict, where: str) -> list[str]:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{where}: no schema for {doc.get('apiVersion')}/{doc.get('kind')} in Kubernetes {K8S_VERSION}"]
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        return [f"{where}: {path}: {exc.message}"]
    return []


@pytest.fixture(scope="module")
def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module", params=DASHBOARDS, ids=lambda p: p.name)
def any_dashboard(request: pytest.FixtureRequest) -> dict:
    return json.loads(request.param.read_text())


def _dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel.get("title", "?"), target.get("expr", "")))
    return out


# ---------------------------------------------------------------- unit checks of the helpers


def test_metric_contract_check_catches_unknown_names():
    assert _unknown_metrics("rate(inferbus_ttft_seconds_bucket[5m])") == set()
    assert _unknown_metrics('sum(rate(inferbus_requests_total{status=~"5.."}[5m]))') == set()
    assert _unknown_metrics("inferbus_ttft_secs_bucket") == {"inferbus_ttft_secs_bucket"}
    assert _unknown_metrics("inferbus_requests_total_bucket") == {"inferbus_requests_total_bucket"}
    assert _unknown_metrics("sglang:num_waiting_reqs") == {"sglang:num_waiting_reqs"}
    # recording-rule names (colons) are not raw metrics
    assert _unknown_metrics("inferbus:ttft_seconds:p90_5m > 0.8") == set()


def test_k8s_validation_rejects_a_broken_manifest():
    doc = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "two", "selector": {}, "template": {"spec": {"containers": []}}},
    }
    assert _validate_k8s(doc, "broken")


# ---------------------------------------------------------------- docker-compose


def test_compose_matches_compose_spec():
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    # The schema declares draft-07; pick the validator explicitly (its $schema URL is non-canonical).
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_compose_services_are_wired():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ["nats", "redis", "gateway", "router", "sim-engine-1", "worker-1", "sim-engine-2", "worker-2"]:
        assert name in services, f"missing service {name}"
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
    assert "-js" in services["nats"]["command"] and "/data" in services["nats"]["command"]
    for worker, engine in [("worker-1", "sim-engine-1"), ("worker-2", "sim-engine-2")]:
        env = services[worker]["environment"]
        assert env["INFERBUS_ENGINE_URL"] == f"http://{engine}:30000"
        assert services[worker]["depends_on"][engine]["condition"] == "service_healthy"
        assert services[worker]["depends_on"]["nats"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    # The GPU pair is opt-in only.
    gpu = [n for n, s in services.items() if "gpu" in s.get("profiles", [])]
    assert gpu, "no service in the gpu profile"
    devices = services["sglang"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["count"] == 2 and "gpu" in devices[0]["capabilities"]


def test_compose_pd_profile_runs_a_prefill_and_a_decode_pair():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    pd = {n: s for n, s in services.items() if "pd" in s.get("profiles", [])}
    assert set(pd) == {"sim-engine-prefill-1", "worker-prefill-1", "sim-engine-decode-1", "worker-decode-1"}
    for role in ("prefill", "decode"):
        engine, worker = pd[f"sim-engine-{role}-1"], pd[f"worker-{role}-1"]
        command = engine["command"]
        assert command[command.index("--disaggregation-mode") + 1] == role
        env = worker["environment"]
        assert env["INFERBUS_WORKER_ROLE"] == role
        assert env["INFERBUS_ENGINE_URL"] == f"http://sim-engine-{role}-1:30000"
        assert worker["depends_on"][f"sim-engine-{role}-1"]["condition"] == "service_healthy"
        assert "healthcheck" in engine and "healthcheck" in worker
    # Decode engines reach the prefill engine's bootstrap server by the name the prefill worker announces.
    prefill = pd["sim-engine-prefill-1"]["command"]
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert pd["worker-prefill-1"]["environment"]["INFERBUS_ENGINE_BOOTSTRAP_HOST"] == "sim-engine-prefill-1"
    assert "default" in pd["sim-engine-prefill-1"]["networks"] and "default" in pd["sim-engine-decode-1"]["networks"]


# ---------------------------------------------------------------- kubernetes


@pytest.mark.slow
@pytest.mark.parametrize("path", _k8s_manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_manifest_is_valid(path: Path):
    docs = _load_yaml_docs(path)
    assert docs, f"{path} is empty"
    errors = []
    for i, doc in enumerate(docs):
        errors += _validate_k8s(doc, f"{path.name}[{i}] {doc.get('kind')}/{doc.get('metadata', {}).get('name')}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("kdir", _kustomization_dirs(), ids=lambda p: str(p.relative_to(K8S)) or ".")
def test_kustomization_resources_exist(kdir: Path):
    kust = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    assert kust["resources"], f"{kdir} lists no resources"
    for res in kust["resources"]:
        target = (kdir / res).resolve()
        assert target.exists(), f"{kdir}/kustomization.yaml lists {res}, which does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").exists(), f"{res} is a directory without kustomization.yaml"


def test_every_manifest_is_listed_in_a_kustomization():
    listed = set()
    for kfile in K8S.rglob("kustomization.yaml"):  # Components' own resources count too
        kust = yaml.safe_load(kfile.read_text())
        listed |= {(kfile.parent / r).resolve() for r in kust.get("resources", [])}
    unlisted = [str(p.relative_to(K8S)) for p in _k8s_manifest_files() if p.resolve() not in listed]
    assert not unlisted, f"manifests no kustomization applies: {unlisted}"


def _render(kdir: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed: kustomize rendering not checked (manifests are still validated one by one)")
    out = subprocess.run([kubectl, "kustomize", str(kdir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.slow
@pytest.mark.parametrize("kdir", [K8S, K8S / "staging"], ids=["production", "staging"])
def test_kustomize_renders_valid_objects(kdir: Path):
    docs = _render(kdir)
    errors = []
    for doc in docs:
        errors += _validate_k8s(doc, f"{doc['kind']}/{doc['metadata']['name']}")
    assert not errors, "\n".join(errors)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [("StatefulSet", "nats"), ("Deployment", "gateway"), ("Deployment", "router"),
                     ("HorizontalPodAutoscaler", "gateway"), ("PodDisruptionBudget", "gateway"),
                     ("ConfigMap", "inferbus-config")]:
        assert expected in kinds, f"{kdir.name}: {expected} not rendered"
    # Real and simulated workers must never share a namespace (both pull from `any`). Production
    # runs the plan's topology: deploy/k8s/plan is disaggregated, so its prefill pool beside `worker`.
    workers = {name for kind, name in kinds if kind == "Deployment" and name.startswith("worker")}
    assert workers == ({"worker", "worker-prefill"} if kdir == K8S else {"worker-sim"}), workers


def _deployments() -> dict[str, dict]:
    out = {}
    for path in _k8s_manifest_files():
        for doc in _load_yaml_docs(path):
            if doc["kind"] in ("Deployment", "StatefulSet"):
                out[doc["metadata"]["name"]] = doc
    return out


@pytest.mark.slow
def test_workers_pair_with_an_engine_sidecar_and_drain():
    deps = _deployments()
    for name, engine_port in [("worker", 30000), ("worker-sim", 30000)]:
        spec = deps[name]["spec"]["template"]["spec"]
        sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        assert len(sidecars) == 1, f"{name}: expected one native sidecar engine"
        assert any(p["containerPort"] == engine_port for p in sidecars[0]["ports"])
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        env = {e["name"]: e for e in worker["env"]}
        assert env["INFERBUS_ENGINE_URL"]["value"] == f"http://127.0.0.1:{engine_port}"
        assert spec["terminationGracePeriodSeconds"] >= 120, f"{name}: too short to drain"
    [gpu] = [c for c in deps["worker"]["spec"]["template"]["spec"]["initContainers"] if c["name"] == "sglang"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 2


@pytest.mark.slow
def test_gateway_probes():
    c = _deployments()["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.slow
def test_nats_has_jetstream_and_a_volume():
    nats = _deployments()["nats"]
    c = nats["spec"]["template"]["spec"]["containers"][0]
    assert "-js" in c["args"] and "-sd" in c["args"]
    tag = c["image"].split(":")[1]
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", tag).groups())
    assert (major, minor) >= (2, 11), c["image"]
    assert nats["spec"]["volumeClaimTemplates"]


# ---------------------------------------------------------------- prometheus


def test_rules_structure(rules: dict):
    assert rules["groups"], "no rule groups"
    names = set()
    problems = []
    for group in rules["groups"]:
        assert group["name"] not in names, f"duplicate group {group['name']}"
        names.add(group["name"])
        assert group["rules"], f"group {group['name']} is empty"
        for rule in group["rules"]:
            ident = rule.get("alert") or rule.get("record") or "?"
            if ("alert" in rule) == ("record" in rule):
                problems.append(f"{ident}: must have exactly one of alert/record")
            if not str(rule.get("expr", "")).strip():
                problems.append(f"{ident}: no expr")
            if "alert" in rule:
                if "for" not in rule:
                    problems.append(f"{ident}: no `for`")
                if not rule.get("labels", {}).get("severity"):
                    problems.append(f"{ident}: no severity label")
                annotations = rule.get("annotations", {})
                if not annotations.get("summary") or not annotations.get("description"):
                    problems.append(f"{ident}: needs summary and description annotations")
            else:
                if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"]) or ":" not in rule["record"]:
                    problems.append(f"{ident}: record name should be level:metric:operations")
    assert not problems, "\n".join(problems)


def test_rules_cover_the_slos(rules: dict):
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    records = {r["record"]: r for g in rules["groups"] for r in g["rules"] if "record" in r}
    assert "0.8" in alerts["InferbusTTFTP90High"]["expr"] and alerts["InferbusTTFTP90High"]["for"] == "10m"
    assert "0.04" in alerts["InferbusTPOTP90High"]["expr"]
    burn = alerts["InferbusErrorBudgetBurnFast"]["expr"]
    assert "14.4" in burn and "0.001" in burn and "ratio_rate1h" in burn and "ratio_rate5m" in burn
    for expected in ["InferbusErrorBudgetBurnSlow", "InferbusMigrationsSpike", "InferbusWorkerDown"]:
        assert expected in alerts
    for expected in ["inferbus:ttft_seconds:p90_5m", "inferbus:tpot_seconds:p90_5m",
                     "inferbus:requests_5xx:ratio_rate5m", "inferbus:tokens:rate5m"]:
        assert expected in records


def test_rules_use_only_contract_metrics_and_defined_records(rules: dict):
    defined = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    problems = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            ident = rule.get("alert") or rule.get("record")
            unknown = _unknown_metrics(rule["expr"])
            if unknown:
                problems.append(f"{ident}: metrics not in the contract: {sorted(unknown)}")
            undefined = set(_RECORDED_NAME.findall(rule["expr"])) - defined
            if undefined:
                problems.append(f"{ident}: uses recording rules nobody defines: {sorted(undefined)}")
    assert not problems, "\n".join(problems)


def _promtool() -> str:
    """promtool on the PATH, or the one `make install` put in the virtualenv."""
    beside = Path(sys.executable).parent / "promtool"
    promtool = shutil.which("promtool") or (str(beside) if beside.exists() else None)
    if not promtool and os.environ.get("INFERBUS_REQUIRE_PROMTOOL"):  # CI: a check that skips proves nothing
        pytest.fail("INFERBUS_REQUIRE_PROMTOOL is set and promtool is not installed (`make install` fetches it)")
    if not promtool:
        pytest.skip("promtool not installed (`make install` fetches it; Debian package `prometheus`): "
                    "PromQL syntax not checked")
    return promtool


@pytest.mark.slow
def test_rules_pass_promtool():
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_dashboard_queries_pass_promtool(any_dashboard: dict, tmp_path: Path):
    dashboard = any_dashboard
    promtool = _promtool()
    # Wrap each panel query as a recording rule so promtool parses it; Grafana's range
    # variables become a fixed window.
    rules = [
        {
            "record": f"dashboard:panel_query:{i}",
            "expr": expr.replace("$__rate_interval", "5m").replace("$__range", "1h"),
        }
        for i, (_, expr) in enumerate(_dashboard_exprs(dashboard))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- grafana


def test_dashboard_structure(any_dashboard: dict):
    dashboard = any_dashboard
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    problems = []
    for panel in dashboard["panels"]:
        title = panel.get("title", "?")
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{title}: datasource is not ${{datasource}}")
        targets = panel.get("targets") or []
        if not targets or not all(str(t.get("expr", "")).strip() for t in targets):
            problems.append(f"{title}: panel without a query")
        if len({t.get("refId") for t in targets}) != len(targets):
            problems.append(f"{title}: duplicate refIds")
    assert not problems, "\n".join(problems)


def test_dashboard_has_the_slo_panels(dashboard: dict):
    panels = {p["title"]: p for p in dashboard["panels"]}

    def threshold_steps(title_start: str) -> list:
        panel = next(p for t, p in panels.items() if t.startswith(title_start))
        return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    assert 0.8 in threshold_steps("TTFT")
    assert 0.04 in threshold_steps("TPOT")
    exprs = " ".join(e for _, e in _dashboard_exprs(dashboard))
    for needed in ["inferbus_requests_total", "inferbus_queue_wait_seconds_bucket", "inferbus_tokens_total",
                   'kind="cached"', "inferbus_inflight_requests", "inferbus_worker_running_requests",
                   "inferbus_worker_kv_usage_ratio", "inferbus_migrations_total"]:
        assert needed in exprs, f"no panel queries {needed}"


def test_dashboard_uses_only_contract_metrics(any_dashboard: dict):
    dashboard = any_dashboard
    problems = []
    for title, expr in _dashboard_exprs(dashboard):
        unknown = _unknown_metrics(expr)
        if unknown:
            problems.append(f"{title}: metrics not in the contract: {sorted(unknown)}")
    assert not problems, "\n".join(problems)


def test_dashboards_have_distinct_uids():
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids)) and len(uids) >= 2, uids


def test_billing_dashboard_shows_spend_tokens_and_service_levels():
    dashboard = json.loads(BILLING_DASHBOARD.read_text())
    exprs = " ".join(e for _, e in _dashboard_exprs(dashboard))
    for needed in ["inferbus_billing_dollars_total", "inferbus_billing_tokens_total", "by (tenant)",
                   "inferbus_ttft_seconds_bucket", "inferbus_tpot_seconds_bucket", "inferbus_queue_wait_seconds_bucket",
                   "inferbus_billing_events_total", "inferbus_billing_ledger_pending_events"]:
        assert needed in exprs, f"no billing panel queries {needed}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "label_values(inferbus_billing_dollars_total, tenant)" in json.dumps(variables["tenant"])
    panels = {p["title"]: p for p in dashboard["panels"]}
    assert 0.8 in [
        s["value"]
        for s in next(p for t, p in panels.items() if t.startswith("TTFT"))["fieldConfig"]["defaults"]["thresholds"][
            "steps"
        ]
    ]


def test_billing_metrics_in_the_contract_are_the_ones_billing_exports():
    from prometheus_client import REGISTRY

    import services.billing.metrics  # noqa: F401  (registers them)

    exported = {metric.name for metric in REGISTRY.collect()}
    # prometheus_client reports counters without their _total suffix.
    exported |= {name + "_total" for name in exported}
    missing = (BILLING_METRICS | {"inferbus_billing_batch_seconds"}) - exported
    assert not missing, f"in the contract but not exported by services/billing/metrics.py: {sorted(missing)}"


@pytest.mark.slow
def test_slo_alerts_fire_on_synthetic_series(rules: dict, tmp_path: Path):
    """promtool unit test: the SLO alerts fire when the SLO is broken and stay quiet when it is not."""
    promtool = _promtool()
    # promtool compares rendered annotations too; strip them so the test pins labels only.
    stripped = json.loads(json.dumps(rules))
    for group in stripped["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules_path = tmp_path / "rules.yml"
    rules_path.write_text(yaml.safe_dump(stripped))

    def hist(name: str, le_counts: dict[str, int]) -> list[dict]:
        return [{"series": f'{name}_bucket{{le="{le}"}}', "values": f"0+{n}x90"} for le, n in le_counts.items()]

    def alert(at: str, name: str, labels: dict | None) -> dict:
        return {"eval_time": at, "alertname": name,
                "exp_alerts": [{"exp_labels": labels}] if labels is not None else []}

    slow = {  # every request in (0.5 s, 1 s] TTFT and (40 ms, 80 ms] TPOT: p90 ~ 0.95 s and ~ 76 ms
        "interval": "30s",
        "input_series": hist("inferbus_ttft_seconds", {"0.5": 0, "1": 10, "+Inf": 10})
        + hist("inferbus_tpot_seconds", {"0.04": 0, "0.08": 10, "+Inf": 10})
        + [
            {"series": 'inferbus_requests_total{endpoint="/v1/chat/completions",status="200"}', "values": "0+100x90"},
            {"series": 'inferbus_requests_total{endpoint="/v1/chat/completions",status="503"}', "values": "0+5x90"},
        ],
        "alert_rule_test": [
            alert("5m", "InferbusTTFTP90High", None),  # not yet: `for: 10m`
            alert("25m", "InferbusTTFTP90High", {"severity": "page", "slo": "ttft", "service": "inferbus"}),
            alert("25m", "InferbusTPOTP90High", {"severity": "page", "slo": "tpot", "service": "inferbus"}),
            alert(
                "20m", "InferbusErrorBudgetBurnFast", {"severity": "page", "slo": "availability", "service": "inferbus"}
            ),
        ],
    }
    healthy = {  # TTFT <= 0.5 s, TPOT <= 30 ms, 5xx 0.05% (half the budget)
        "interval": "30s",
        "input_series": hist("inferbus_ttft_seconds", {"0.5": 10, "1": 10, "+Inf": 10})
        + hist("inferbus_tpot_seconds", {"0.03": 10, "0.04": 10, "+Inf": 10})
        + [{"series": 'inferbus_requests_total{endpoint="/v1/chat/completions",status="200"}', "values": "0+2000x90"},
           {"series": 'inferbus_requests_total{endpoint="/v1/chat/completions",status="503"}', "values": "0+1x90"}],
        "alert_rule_test": [
            alert("40m", "InferbusTTFTP90High", None),
            alert("40m", "InferbusTPOTP90High", None),
            alert("40m", "InferbusErrorBudgetBurnFast", None),
        ],
    }
    test_path = tmp_path / "rules_test.yml"
    test_path.write_text(yaml.safe_dump({
        "rule_files": [str(rules_path)], "evaluation_interval": "30s", "tests": [slow, healthy],
    }))
    out = subprocess.run([promtool, "test", "rules", str(test_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
