"""A disaggregated plan deploys both pools: `inferbus plan --emit-deploy` writes the prefill pool
and the decode pool (TP, counts, roles) and the autoscaler's per-pool bounds, all from the plan
(tools/capacity/plan/deploy.py)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from inferbus.runtime.settings import load
from services.autoscaler.roles import role_pool
from services.autoscaler.settings import AutoscalerSettings
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.plan import deploy
from tools.capacity.plan.disagg import DisaggRow
from tools.capacity.plan.model import Slo, Workload
from tools.capacity.plan.planner import Plan, PlanInputs, make_plan
from tools.capacity.plan.topology import plan_topology
from tools.capacity.plan.warm_pool import Ramp
from tools.commands.plan import plan as plan_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BASE_WORKER = (REPO / "deploy" / "k8s" / "worker.yaml").read_text()
MODEL = "meta-llama/Llama-3.3-70B-Instruct"


@pytest.fixture(scope="module")
def planned() -> tuple[Plan, DisaggRow]:
    # The worked example with TP 2/4/8 and a ramp (warm pools in both): disaggregated wins.
    mix = mix_mod.worked_example()
    inputs = PlanInputs(rate_rps=833.3, rate_text="833.3 requests/s", workload=Workload.from_mix(mix),
                        mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5}, tps=[2, 4, 8],
                        ramp=Ramp(0.5, "given"), cold_start_s=600.0)
    plan = make_plan(inputs)
    choice = plan_topology(plan)
    assert choice.topology == "disaggregated" and choice.disaggregated is not None
    row = choice.disaggregated
    # Every pool number differs between the roles, so a swap of any of them is caught.
    assert row.tp_prefill != row.tp_decode and row.prefill_replicas != row.decode_replicas
    assert row.prefill_warm is not None and row.decode_warm is not None
    assert row.prefill_warm.replicas != row.decode_warm.replicas
    return plan, row


def _files(planned: tuple[Plan, DisaggRow]) -> dict[str, str]:
    plan, row = planned
    return deploy.disaggregated_overlay(plan, row, deploy.DeployTarget(model=MODEL, command="inferbus plan …"),
                                        BASE_WORKER)


def _flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args, args[1:]))


def _env(container: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_overlay_lists_both_pools(planned: tuple[Plan, DisaggRow]) -> None:
    files = _files(planned)
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["kind"] == "Component"
    assert kustomization["resources"] == ["worker-prefill.yaml"]
    assert [p["path"] for p in kustomization["patches"]] == ["worker-patch.yaml", "worker-pdb-patch.yaml",
                                                            "autoscaler-patch.yaml", "autoscaler-role-patch.yaml"]
    assert set(files) == {
        "kustomization.yaml",
        *kustomization["resources"],
        *(p["path"] for p in kustomization["patches"]),
    }
    _, row = planned
    assert f"# cost = {row.gpus_total} x $2.50" in files["kustomization.yaml"]


def test_the_decode_pool_is_the_worker_deployment_with_the_plans_decode_engine(planned: tuple[Plan, DisaggRow]) -> None:
    _, row = planned
    patch = yaml.safe_load(_files(planned)["worker-patch.yaml"])
    assert patch["metadata"]["name"] == "worker"
    assert patch["spec"]["selector"]["matchLabels"] == {deploy.ROLE_LABEL: "decode"}
    assert patch["spec"]["template"]["metadata"]["labels"] == {deploy.ROLE_LABEL: "decode"}
    pod = patch["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == {deploy.ROLE_LABEL: "decode"}
    assert [c["name"] for c in pod["initContainers"]] == ["zone", "sglang"]
    engine = pod["initContainers"][1]
    flags = _flags(engine["args"])
    assert flags["--tp"] == str(row.tp_decode) and flags["--disaggregation-mode"] == "decode"
    assert "--disaggregation-bootstrap-port" not in flags
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == row.tp_decode
    assert _env(pod["containers"][0]) == {"INFERBUS_WORKER_STANDBY": "true", "INFERBUS_WORKER_ROLE": "decode"}


def test_each_pool_has_its_own_disruption_budget(planned: tuple[Plan, DisaggRow]) -> None:
    """Two budgets selecting one pod make it unevictable: the base budget, patched, takes the decode
    pool, the prefill pool's its own pods."""
    files = _files(planned)
    base = next(d for d in yaml.safe_load_all(BASE_WORKER) if d and d["kind"] == "PodDisruptionBudget")
    patch = yaml.safe_load(files["worker-pdb-patch.yaml"])
    assert patch["metadata"]["name"] == base["metadata"]["name"] == "worker"
    decode = base["spec"]["selector"]["matchLabels"] | patch["spec"]["selector"]["matchLabels"]
    prefill = next(d for d in yaml.safe_load_all(files["worker-prefill.yaml"]) if d["kind"] == "PodDisruptionBudget")
    selected = prefill["spec"]["selector"]["matchLabels"]
    assert decode[deploy.ROLE_LABEL] == "decode" and selected[deploy.ROLE_LABEL] == "prefill"


def test_the_prefill_pool_is_the_base_worker_with_the_plans_prefill_engine(planned: tuple[Plan, DisaggRow]) -> None:
    _, row = planned
    docs = list(yaml.safe_load_all(_files(planned)["worker-prefill.yaml"]))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert deployment["metadata"]["name"] == deploy.PREFILL_DEPLOYMENT and "replicas" not in deployment["spec"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector[deploy.ROLE_LABEL] == "prefill" and selector["app.kubernetes.io/name"] == "worker"
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in selector.items())
    pod = deployment["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"][deploy.ROLE_LABEL] == "prefill"
    engine = next(c for c in pod["initContainers"] if c["name"] == "sglang")
    flags = _flags(engine["args"])
    assert flags["--tp"] == str(row.tp_prefill) and flags["--disaggregation-mode"] == "prefill"
    assert flags["--disaggregation-bootstrap-port"] == str(deploy.BOOTSTRAP_PORT)
    assert flags["--chunked-prefill-size"] == "2048" and flags["--revision"] == "$(MODEL_REVISION)"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == row.tp_prefill
    assert any(p["containerPort"] == deploy.BOOTSTRAP_PORT for p in engine["ports"])
    assert "MODEL_REVISION" in _env(engine)
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    env = _env(worker)
    assert env["INFERBUS_WORKER_ROLE"] == "prefill" and env["INFERBUS_WORKER_STANDBY"] == "true"
    # The rest is the base worker's: its bus identity and engine address unchanged.
    assert env["NATS_USER"] == "worker" and env["INFERBUS_ENGINE_URL"] == "http://127.0.0.1:30000"


def test_the_autoscaler_bounds_are_each_pools_own(planned: tuple[Plan, DisaggRow]) -> None:
    plan, row = planned
    files = _files(planned)
    patch = yaml.safe_load(files["autoscaler-patch.yaml"])
    env = _env(patch["spec"]["template"]["spec"]["containers"][0])
    assert env["INFERBUS_AUTOSCALER_DISAGGREGATED"] == "true"
    assert env["INFERBUS_AUTOSCALER_MAX_SERVING"] == str(row.decode_replicas)
    assert env["INFERBUS_AUTOSCALER_PREFILL_MAX_SERVING"] == str(row.prefill_replicas)
    assert row.decode_warm is not None and row.prefill_warm is not None
    assert env["INFERBUS_AUTOSCALER_MAX_WARM"] == str(row.decode_warm.replicas)
    assert env["INFERBUS_AUTOSCALER_PREFILL_MAX_WARM"] == str(row.prefill_warm.replicas)
    assert env["INFERBUS_AUTOSCALER_MAX_REPLICAS"] == str(row.decode_replicas + row.decode_warm.replicas)
    assert env["INFERBUS_AUTOSCALER_PREFILL_MAX_REPLICAS"] == str(row.prefill_replicas + row.prefill_warm.replicas)
    assert row.decode_rps - 1e-3 < float(env["INFERBUS_AUTOSCALER_GOODPUT_RPS"]) <= row.decode_rps
    assert row.prefill_rps - 1e-3 < float(env["INFERBUS_AUTOSCALER_PREFILL_GOODPUT_RPS"]) <= row.prefill_rps
    assert float(env["INFERBUS_AUTOSCALER_PREFILL_TTFT_BUDGET_S"]) == pytest.approx(
        row.prefill_budget_s + row.transfer_p90_s, rel=1e-3)
    assert float(env["INFERBUS_AUTOSCALER_PREFILL_TTFT_BUDGET_S"]) < plan.inputs.slo.ttft_p90_s
    role = yaml.safe_load(files["autoscaler-role-patch.yaml"])
    assert role["kind"] == "Role" and role["rules"][0]["resourceNames"] == ["worker", deploy.PREFILL_DEPLOYMENT]


def test_the_autoscaler_reads_the_emitted_bounds_as_the_plan_sized_each_pool(planned: tuple[Plan, DisaggRow],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The emitted env is settings the autoscaler accepts, and its two pools come out with each
    pool's own goodput and bounds."""
    _, row = planned
    patch = yaml.safe_load(_files(planned)["autoscaler-patch.yaml"])
    for name, value in _env(patch["spec"]["template"]["spec"]["containers"][0]).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "kubernetes")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_K8S_DEPLOYMENTS", "worker")
    monkeypatch.setenv("INFERBUS_MODEL", MODEL)
    monkeypatch.delenv("INFERBUS_AUTOSCALER_POOLS", raising=False)
    settings = load(AutoscalerSettings)
    configs = settings.role_configs()
    assert (configs["prefill"].max_serving, configs["decode"].max_serving) == (
        row.prefill_replicas,
        row.decode_replicas,
    )
    assert configs["prefill"].goodput_rps == pytest.approx(row.prefill_rps, abs=1e-3)
    assert configs["decode"].goodput_rps == pytest.approx(row.decode_rps, abs=1e-3)
    # The router pools the prefill queues: one prefill replica's goodput by the replicas serving,
    # from each replica's own queue (fewer than four do not pool) up to the plan's pool.
    assert row.prefill_pooled is not None and row.prefill_pool is not None
    table = configs["prefill"].goodput_by_serving
    assert [n for n, _ in table] == [n for n, _ in row.prefill_pooled.table()]
    assert [g for _, g in table] == pytest.approx([g for _, g in row.prefill_pooled.table()], abs=1e-3)
    assert table[0][0] == 1 and table[1][0] == 4 and table[-1][0] == row.prefill_replicas
    assert all(a[1] < b[1] for a, b in zip(table, table[1:], strict=False))  # a larger pool waits less
    assert row.prefill_pooled.goodput_at(row.prefill_pool) == pytest.approx(row.prefill_rps)
    assert configs["decode"].goodput_by_serving == ()  # a decode pool has no prefill queue to pool
    # What the plan's pool serves, the autoscaler sizes at no more than the plan's replicas; at a
    # 40th of it, with more than the plan's one number would give (3 replicas that do not pool).
    rate = planned[0].inputs.rate_rps
    assert configs["prefill"].serving_for(rate) <= row.prefill_replicas
    alone = dataclasses.replace(configs["prefill"], goodput_by_serving=())
    assert configs["prefill"].serving_for(rate / 40) == 4 and alone.serving_for(rate / 40) == 3
    assert settings.deployments() == {role_pool(MODEL, "decode"): "worker",
                                      role_pool(MODEL, "prefill"): deploy.PREFILL_DEPLOYMENT}


def _emit(tmp_path: Path, *extra: str, mix: str | None = None, rps: str = "833.3") -> tuple[int, str]:
    args = ["--rps", rps, "--tp", "4,8", "--gpu", "H100:2.5", "--no-compare", *extra]
    if mix is not None:
        args += ["--mix", mix]
    result = CliRunner().invoke(plan_command, args, catch_exceptions=False)
    return result.exit_code, result.output


def test_plan_emit_deploy_writes_both_pools_of_a_disaggregated_plan(tmp_path: Path) -> None:
    k8s = tmp_path / "k8s"
    k8s.mkdir()
    shutil.copy(REPO / "deploy" / "k8s" / "worker.yaml", k8s / "worker.yaml")
    code, output = _emit(tmp_path, "--emit-deploy", str(k8s / "plan"))
    assert code == 0, output
    assert "Topology: disaggregated" in output and "Wrote the H100 prefill TP4 + decode TP4 overlay" in output
    written = {p.name for p in (k8s / "plan").iterdir()}
    assert written == {"kustomization.yaml", "worker-patch.yaml", "worker-pdb-patch.yaml", "worker-prefill.yaml",
                       "autoscaler-patch.yaml", "autoscaler-role-patch.yaml"}
    header = (k8s / "plan" / "kustomization.yaml").read_text()
    assert "--emit-deploy" in header and "--worker-manifest" not in header
    prefill = next(d for d in yaml.safe_load_all((k8s / "plan" / "worker-prefill.yaml").read_text())
                   if d["kind"] == "Deployment")
    engine = next(c for c in prefill["spec"]["template"]["spec"]["initContainers"] if c["name"] == "sglang")
    assert _flags(engine["args"])["--tp"] == "4"


def test_plan_emit_deploy_needs_the_base_worker_for_the_prefill_pool(tmp_path: Path) -> None:
    code, output = _emit(tmp_path, "--emit-deploy", str(tmp_path / "plan"))
    assert code != 0 and "--worker-manifest" in output
    code, output = _emit(tmp_path, "--emit-deploy", str(tmp_path / "plan"), "--worker-manifest",
                         str(REPO / "deploy" / "k8s" / "worker.yaml"))
    assert code == 0, output
    assert (tmp_path / "plan" / "worker-prefill.yaml").exists()


def test_an_aggregated_choice_emits_one_pool(tmp_path: Path) -> None:
    # Mooncake synthetic (long prompts, short answers) at 20 req/s stays aggregated.
    code, output = _emit(
        tmp_path, "--emit-deploy", str(tmp_path / "plan"), mix=str(traces.find("mooncake_synthetic.jsonl")), rps="20"
    )
    assert code == 0, output
    assert "Topology: aggregated" in output
    assert {p.name for p in (tmp_path / "plan").iterdir()} == {"kustomization.yaml", "worker-patch.yaml",
                                                               "autoscaler-patch.yaml"}
    worker = yaml.safe_load((tmp_path / "plan" / "worker-patch.yaml").read_text())
    assert "--disaggregation-mode" not in worker["spec"]["template"]["spec"]["initContainers"][1]["args"]
    assert math.isfinite(float(yaml.safe_load((tmp_path / "plan" / "autoscaler-patch.yaml").read_text())
                               ["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"]))


def test_the_production_kustomization_renders_both_pools(tmp_path: Path) -> None:
    """kustomize (kubectl's) renders the production kustomization with the disaggregated overlay in
    place of the shipped one: two worker Deployments with disjoint selectors, one budget each."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed: kustomize rendering not checked")
    k8s = tmp_path / "k8s"
    shutil.copytree(REPO / "deploy" / "k8s", k8s)
    shutil.rmtree(k8s / "plan")
    code, output = _emit(tmp_path, "--emit-deploy", str(k8s / "plan"))
    assert code == 0, output
    out = subprocess.run([kubectl, "kustomize", str(k8s)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    workers = {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("worker")
    }
    assert set(workers) == {"worker", deploy.PREFILL_DEPLOYMENT}
    roles = {}
    for name, d in workers.items():
        selector = d["spec"]["selector"]["matchLabels"]
        assert all(d["spec"]["template"]["metadata"]["labels"][k] == v for k, v in selector.items())
        engine = next(c for c in d["spec"]["template"]["spec"]["initContainers"] if c["name"] == "sglang")
        worker = next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
        roles[name] = (selector[deploy.ROLE_LABEL], _flags(engine["args"])["--disaggregation-mode"],
                       _env(worker)["INFERBUS_WORKER_ROLE"], _flags(engine["args"])["--tp"])
    assert roles == {"worker": ("decode", "decode", "decode", "4"),
                     deploy.PREFILL_DEPLOYMENT: ("prefill", "prefill", "prefill", "4")}
    budgets = [
        d["spec"]["selector"]["matchLabels"][deploy.ROLE_LABEL]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
        and d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name") == "worker"
    ]
    assert sorted(budgets) == ["decode", "prefill"]
