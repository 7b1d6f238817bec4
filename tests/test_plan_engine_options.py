"""Engine options in the timing model and the planner, against hand arithmetic; the warm pool and
zone headroom in the price; the plan's kustomize overlay and its drift from the shipped one."""

from __future__ import annotations

import dataclasses
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from inferbus.runtime.settings import load
from inferbus.timing import (
    SpecDecoding,
    expected_distinct_adapters,
    lora_adapter_bytes,
    lora_load_s,
    roofline,
)
from services.autoscaler.settings import AutoscalerSettings
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.plan import deploy, options
from tools.capacity.plan.model import Slo, Workload
from tools.capacity.plan.planner import PlanInputs, make_plan
from tools.capacity.plan.warm_pool import Ramp
from tools.commands.plan import plan as plan_command

REPO = Path(__file__).resolve().parents[1]
PLAN_DIR = REPO / "deploy" / "k8s" / "plan"
WORKLOAD = Workload.from_mix(mix_mod.load("worked-example", None))

# H100 TP2 by hand: base 1.5 ms + 160 × 18 µs = 4.38 ms; FP8 weights 70.6e9 B ÷ (2 × 3.35e12 B/s × 0.75)
# = 14.0498 ms; GEMM per token 2 × 70.6e9 ÷ (2 × 1979e12 × 0.5) = 0.071349 ms; FP8 KV per token
# 163,840 B ÷ (2 × 3.35e12 × 0.5) = 48.907 ns; c_seq 0.05 ms; γ 0.25.
BASE_TP2, WEIGHTS_TP2, GEMM_TP2, KV_TP2 = 4.38e-3, 14.0498e-3, 0.071349e-3, 48.907e-9


# ---- precision ------------------------------------------------------------------------------

def test_bf16_weights_double_the_bytes_and_halve_the_gemm_rate() -> None:
    # H100 TP4, B = 1 over 2,048 tokens, BF16 weights and KV:
    # base 1.5 + 160 × 22 µs = 5.02 ms; weights 141.2e9 ÷ (4 × 3.35e12 × 0.75) = 14.0498 ms;
    # GEMM 2 × 70.6e9 ÷ (4 × 989e12 × 0.5) = 0.071385 ms; KV 2,048 × 327,680 ÷ (4 × 3.35e12 × 0.5)
    # = 0.10017 ms; t = 5.02 + 14.0498 + 0.25 × 0.071385 + 0.10017 + 0.05 = 19.2378 ms.
    model = roofline("H100", 4, weights="bf16", kv_cache="bf16")
    assert model.step_time(1, 2048) == pytest.approx(19.2378e-3, rel=1e-4)
    assert model.gemm_flops == 989e12 and model.model.kv_bytes_per_token == 327_680


def test_kv_capacity_by_precision() -> None:
    # (2 × 80 × 0.92 − 70.6 − 2 × 4) GB ÷ 327,680 B = 209,350 tokens with a BF16 KV cache (FP8: twice).
    assert roofline("H100", 2, kv_cache="bf16").kv_capacity_tokens() == pytest.approx(209_350, abs=2)
    assert roofline("H100", 2).kv_capacity_tokens() == pytest.approx(418_700, abs=4)
    # BF16 weights on 2 × 80 GB: 141.2 + 8 > 147.2 GB usable, no KV at all; on 4 × 80 GB:
    # (294.4 − 141.2 − 16) GB ÷ 327,680 B = 418,701 tokens.
    assert roofline("H100", 2, weights="bf16", kv_cache="bf16").kv_capacity_tokens() == 0
    assert roofline("H100", 4, weights="bf16", kv_cache="bf16").kv_capacity_tokens() == pytest.approx(418_701, abs=2)


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        roofline("H100", 2, weights="int4")


# ---- speculative decoding -------------------------------------------------------------------

def test_tokens_per_step_is_leviathans_expectation() -> None:
    # E = (1 − α^(k+1)) ÷ (1 − α): k = 3, α = 0.7 → (1 − 0.2401) ÷ 0.3 = 2.533.
    assert SpecDecoding(3, 0.7).tokens_per_step == pytest.approx(2.5330, abs=1e-4)
    assert SpecDecoding(4, 0.0).tokens_per_step == 1.0  # nothing accepted: the verify step's own token
    with pytest.raises(ValueError):
        SpecDecoding(0, 0.5)
    with pytest.raises(ValueError):
        SpecDecoding(3, 1.0)


def test_speculative_step_is_draft_plus_a_wider_verify() -> None:
    # B = 32 over 65,536 tokens, k = 3: verify GEMM carries 128 tokens = 9.1327 ms (< weights 14.0498);
    # verify = 4.38 + 14.0498 + 0.25 × 9.1327 + 65,536 × 48.907 ns + 32 × 0.05 ms = 25.5182 ms.
    # Draft step = 0.1 × the plain decode step (GEMM 32 tokens 2.2832 ms): 0.1 × 23.8056 ms, × 3 = 7.1417 ms.
    spec = roofline("H100", 2, spec=SpecDecoding(3, 0.7, draft_cost=0.1))
    verify = BASE_TP2 + WEIGHTS_TP2 + 0.25 * 128 * GEMM_TP2 + 65_536 * KV_TP2 + 32 * 0.05e-3
    plain = BASE_TP2 + WEIGHTS_TP2 + 0.25 * 32 * GEMM_TP2 + 65_536 * KV_TP2 + 32 * 0.05e-3
    assert verify == pytest.approx(25.518e-3, rel=1e-4) and plain == pytest.approx(23.806e-3, rel=1e-4)
    assert spec.step_time(32, 65_536) == pytest.approx(verify + 3 * 0.1 * plain, rel=1e-6)
    assert roofline("H100", 2).step_time(32, 65_536) == pytest.approx(plain, rel=1e-6)
    # Per token: 32.66 ms ÷ 2.533 = 12.9 ms against 23.8 ms without.
    assert spec.step_time(32, 65_536) / spec.tokens_per_step == pytest.approx(12.894e-3, rel=1e-3)


@pytest.mark.slow
def test_planner_turns_speculative_decoding_on_only_where_it_raises_goodput() -> None:
    def row(spec: SpecDecoding):  # type: ignore[no-untyped-def]
        # Each replica its own prefill queue: the goodputs compared are then the row's own.
        inputs = PlanInputs(rate_rps=100.0, rate_text="100 requests/s", workload=WORKLOAD, mix={}, slo=Slo(),
                            gpu_prices={"H100": 2.5}, tps=[2], spec=spec, prefill_queue="per-replica")
        return make_plan(inputs).rows[0]

    useful = row(SpecDecoding(3, 0.7))
    assert useful.spec_on and useful.spec_goodput_rps > useful.plain_goodput_rps
    assert useful.goodput_rps == useful.spec_goodput_rps
    # Nothing accepted: every draft is wasted work, so the row keeps plain decoding.
    useless = row(SpecDecoding(3, 0.0))
    assert not useless.spec_on and useless.spec_goodput_rps < useless.plain_goodput_rps
    assert useless.goodput_rps == useless.plain_goodput_rps


# ---- LoRA -----------------------------------------------------------------------------------

def test_lora_adapter_size_and_load_time() -> None:
    # Rank 16 on q, k, v, o, gate, up, down of 80 layers, BF16: per layer
    # (8192 + 8192) + 2 × (8192 + 1024) + (8192 + 8192) + 2 × (8192 + 28672) + (28672 + 8192) = 161,792
    # elements per unit of rank → 161,792 × 16 × 80 × 2 B = 414,187,520 B.
    assert lora_adapter_bytes(16) == 414_187_520
    # 50 ms + 414.19 MB ÷ 25 GB/s = 66.57 ms.
    assert lora_load_s(16) == pytest.approx(0.066567, rel=1e-4)


def test_lora_step_cost_by_rank_and_distinct_adapters() -> None:
    # H100 TP2, rank 16, 4 distinct adapters over 32 tokens: launches 80 layers × 4 fused modules
    # × 2 kernels × 1 µs = 0.64 ms; reads 4 × 414.19 MB ÷ (2 × 3.35e12 × 0.75) = 0.32970 ms;
    # GEMM 2 × 32 × 207.09e6 ÷ (2 × 989e12 × 0.5) = 0.0134 ms → 0.9831 ms.
    model = roofline("H100", 2, lora_rank=16, lora_slots=8)
    assert model.lora_step_s(32, 4) == pytest.approx(0.9831e-3, rel=1e-3)
    assert model.lora_step_s(32, 0) == 0.0
    assert model.step_time(32, 65_536, lora_adapters=4) - roofline("H100", 2).step_time(32, 65_536) == \
        pytest.approx(model.lora_step_s(32, 4))
    # Rank 64 streams four times the bytes.
    wide = roofline("H100", 2, lora_rank=64, lora_slots=8)
    assert wide.lora_step_s(32, 4) - 0.64e-3 == pytest.approx(4 * (model.lora_step_s(32, 4) - 0.64e-3), rel=1e-6)
    # Slots hold their adapters in HBM: (68.6e9 − 8 × 414.19e6) B ÷ 163,840 B = 398,477 tokens.
    assert model.kv_capacity_tokens() == pytest.approx(398_477, abs=2)


def test_expected_distinct_adapters() -> None:
    # 10 sequences over 4 adapters: 4 × (1 − 0.75^10) = 3.7747; capped by the slots.
    assert expected_distinct_adapters(10, 4, 8) == pytest.approx(3.7747, rel=1e-4)
    assert expected_distinct_adapters(100, 32, 8) == 8.0
    assert expected_distinct_adapters(10, 0, 8) == 0.0


@pytest.mark.slow
def test_more_adapters_cost_goodput() -> None:
    def goodput(adapters: int) -> float:
        inputs = PlanInputs(rate_rps=100.0, rate_text="100 requests/s", workload=WORKLOAD, mix={}, slo=Slo(),
                            gpu_prices={"H100": 2.5}, tps=[2], lora_adapters=adapters)
        return make_plan(inputs).rows[0].goodput_rps

    none, one, many = goodput(0), goodput(1), goodput(32)
    assert none > one > many


# ---- the warm pool and zone headroom in the price -------------------------------------------

def _plan(**kwargs):  # type: ignore[no-untyped-def]
    inputs = PlanInputs(rate_rps=833.0, rate_text="833 requests/s", workload=WORKLOAD, mix={"name": "worked-example"},
                        slo=Slo(), gpu_prices={"H100": 2.5}, tps=[2], **kwargs)
    return make_plan(inputs)


@pytest.mark.slow
def test_warm_pool_and_headroom_are_priced() -> None:
    # Warm pool: ⌈1.9 req/s per s × 600 s cold start ÷ 3.0709 req/s⌉ = ⌈371.23⌉ = 372 replicas.
    row = _plan(ramp=Ramp(1.9, "given"), cold_start_s=600.0).rows[0]
    assert row.replicas == 312  # ⌈833 ÷ 3.0709 × 1.15⌉ = ⌈311.94⌉
    assert row.warm_replicas == 372
    cost = row.cost
    assert cost.serving_gpus == 624 and cost.warm_gpus == 744 and cost.gpus == row.gpus_total == 1368
    assert cost.usd_per_hour == pytest.approx(1368 * 2.5)
    assert cost.serving_usd_per_hour == pytest.approx(624 * 2.5)
    out_mtok_h = 833.0 * WORKLOAD.output_tokens * 3600 / 1e6
    assert cost.usd_per_1m_output_all_in == pytest.approx(1368 * 2.5 / out_mtok_h)
    assert cost.usd_per_1m_output_serving == pytest.approx(624 * 2.5 / out_mtok_h)


@pytest.mark.slow
def test_zone_headroom_sizes_for_a_lost_zone() -> None:
    one, three = _plan().rows[0], _plan(zones=3).rows[0]
    # ⌈833 ÷ 3.0709 × 1.15 × 3 ÷ 2⌉ = ⌈467.92⌉ = 468.
    assert three.replicas == 468 and three.replicas_exact == pytest.approx(one.replicas_exact * 1.5)
    assert three.cost.usd_per_hour == pytest.approx(468 * 2 * 2.5)


# ---- side by side ---------------------------------------------------------------------------

@pytest.mark.slow
def test_options_compare_flips_one_option_at_a_time() -> None:
    base = _plan()
    variants = options.compare(base)
    labels = [v.label for v in variants]
    assert labels[0] == "as planned" and variants[0].same_config is base.rows[0]
    by_label = dict(zip(labels, variants))
    bf16 = by_label["BF16 weights and KV cache"]
    assert bf16.same_config is not None and not bf16.same_config.feasible  # no KV room on 2 × 80 GB
    spec = next(v for v in variants if v.label.startswith("+ speculative decoding"))
    assert spec.same_config.spec_on and spec.same_config.gpus_total < base.rows[0].gpus_total
    lora = [v for v in variants if v.label.startswith("LoRA")]
    assert [v.inputs.lora_adapters for v in lora] == [1, 8, 32]
    assert all(v.same_config.gpus_total >= base.rows[0].gpus_total for v in lora)


# ---- the overlay ----------------------------------------------------------------------------

def _target(**kwargs) -> deploy.DeployTarget:  # type: ignore[no-untyped-def]
    return deploy.DeployTarget(model="meta-llama/Llama-3.3-70B-Instruct", command="inferbus plan …", **kwargs)


@pytest.mark.slow
def test_engine_args_follow_the_plan() -> None:
    plan = _plan(ramp=Ramp(1.9, "given"))
    args = deploy.engine_args(plan, plan.rows[0], _target())
    flags = dict(zip(args, args[1:]))
    assert flags["--tp"] == "2" and flags["--quantization"] == "fp8" and flags["--kv-cache-dtype"] == "fp8_e4m3"
    assert flags["--chunked-prefill-size"] == "2048" and flags["--revision"] == "$(MODEL_REVISION)"
    assert "--speculative-algorithm" not in args
    bf16 = _plan(kv_cache="bf16")
    args = deploy.engine_args(bf16, bf16.rows[0], _target(revision="a" * 40))
    assert dict(zip(args, args[1:]))["--kv-cache-dtype"] == "auto" and "a" * 40 in args


@pytest.mark.slow
def test_speculative_rows_need_a_draft_model() -> None:
    plan = _plan(spec=SpecDecoding(3, 0.7))
    row = plan.rows[0]
    assert row.spec_on
    with pytest.raises(ValueError, match="draft model"):
        deploy.engine_args(plan, row, _target())
    args = deploy.engine_args(plan, row, _target(draft_model="org/eagle-70b"))
    flags = dict(zip(args, args[1:]))
    assert flags["--speculative-num-steps"] == "3" and flags["--speculative-num-draft-tokens"] == "4"
    assert flags["--speculative-draft-model-path"] == "org/eagle-70b"


def test_revision_must_be_a_commit() -> None:
    with pytest.raises(ValueError, match="40-hex"):
        _target(revision="main")


def test_autoscaler_bounds_are_the_plan() -> None:
    plan = _plan(ramp=Ramp(1.9, "given"), zones=3)
    row = plan.rows[0]
    env = dict(deploy.autoscaler_env(plan, row))
    assert env["INFERBUS_AUTOSCALER_MAX_SERVING"] == str(row.replicas)
    assert env["INFERBUS_AUTOSCALER_MAX_WARM"] == str(row.warm_replicas)
    assert env["INFERBUS_AUTOSCALER_MAX_REPLICAS"] == str(row.replicas + row.warm_replicas)
    assert env["INFERBUS_AUTOSCALER_MIN_SERVING"] == "3"
    assert float(env["INFERBUS_AUTOSCALER_HEADROOM"]) == pytest.approx(1.15 * 1.5 - 1, abs=1e-4)
    assert float(env["INFERBUS_AUTOSCALER_GOODPUT_RPS"]) <= row.goodput_rps
    # TPOT binds at every pool size: one goodput says it all.
    assert row.pool is not None and "INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING" not in env


@pytest.mark.slow
def test_a_fleet_whose_ttft_binds_gives_the_autoscaler_its_goodput_by_pool_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Long prompts on TP8: each replica alone waits behind whole prompts (1.54 req/s); seven whose
    queues the router pools serve three times that each. The autoscaler sizes a trough by the
    goodput of the replicas it would leave serving, not by the plan's size."""
    mix = mix_mod.load(traces.find("mooncake_synthetic.jsonl"))
    plan = make_plan(PlanInputs(rate_rps=20.0, rate_text="20 requests/s", workload=Workload.from_mix(mix),
                                mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5}, tps=[8]))
    [row] = plan.rows
    assert row.binding == "TTFT" and row.pool is not None and row.pooled is not None
    env = dict(deploy.autoscaler_env(plan, row))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = load(AutoscalerSettings).policy_config()
    table = config.goodput_by_serving
    assert [n for n, _ in table] == [1, 4, 5, 6, row.replicas]
    assert table[0][1] == pytest.approx(row.pooled.alone, abs=1e-3) and table[0][1] < table[1][1] / 2
    # The plan's pool (one replica down) at the goodput the plan sized it with.
    assert row.pooled.goodput_at(row.pool) == pytest.approx(row.goodput_rps)
    # 6 req/s: three lone replicas serve 3 × 1.54 < 6 × 1.15, four pooled 4 × 3.93 ≥ it; the
    # plan's one number (4.48 req/s a replica) would say two.
    assert config.serving_for(6.0) == 4
    assert dataclasses.replace(config, goodput_by_serving=()).serving_for(6.0) == 2


def test_overlay_files_are_a_kustomize_component() -> None:
    plan = _plan(ramp=Ramp(1.9, "given"))
    files = deploy.overlay(plan, plan.rows[0], _target())
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["kind"] == "Component"
    assert [p["path"] for p in kustomization["patches"]] == ["worker-patch.yaml", "autoscaler-patch.yaml"]
    assert "# GPUs = (312 + 75) x 2 = 774" in files["kustomization.yaml"]
    worker = yaml.safe_load(files["worker-patch.yaml"])
    spec = worker["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["zone", "sglang"]  # the base's order kept
    assert spec["initContainers"][1]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert spec["containers"][0]["env"] == [{"name": "INFERBUS_WORKER_STANDBY", "value": "true"}]


def test_base_worker_runs_the_arguments_every_engine_needs() -> None:
    """The component replaces the engine's argument list: what the base always sets must be in it."""
    worker = next(d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "worker.yaml").read_text())
                  if d and d["kind"] == "Deployment")
    [engine] = [c for c in worker["spec"]["template"]["spec"]["initContainers"] if c["name"] == "sglang"]
    base_args = engine["args"]
    common = list(deploy.COMMON_ENGINE_ARGS)
    for flag in ("--host", "--port", "--page-size", "--kv-events-config"):
        assert base_args[base_args.index(flag) + 1] == common[common.index(flag) + 1], flag
    for flag in ("--enable-metrics", "--enable-priority-scheduling", "--constrained-json-disable-any-whitespace"):
        assert flag in base_args and flag in common


def test_every_shipped_sglang_launch_forbids_free_whitespace_in_forced_json() -> None:
    """SGLang's default JSON grammar allows any whitespace between tokens, which a model can fill
    max_tokens with under response_format or a forced call: every engine the project starts says no."""
    flag = "--constrained-json-disable-any-whitespace"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["sglang"]["command"]
    assert flag in compose
    for path in (REPO / "tests" / "sglang" / "conftest.py", REPO / "tests" / "sglang" / "test_pd_contract.py"):
        assert f'"{flag}"' in path.read_text(), path
    assert flag in deploy.COMMON_ENGINE_ARGS


@pytest.mark.slow
def test_shipped_production_plan_is_what_the_worked_example_emits(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Drift: the command in the shipped overlay's header regenerates it byte for byte."""
    shipped = {p.name: p.read_text() for p in PLAN_DIR.iterdir()}
    header = next(line for line in shipped["kustomization.yaml"].splitlines() if line.startswith("#   inferbus plan"))
    words = shlex.split(header.removeprefix("#   "))[2:]
    monkeypatch.chdir(tmp_path)
    # A disaggregated plan's prefill pool copies the base worker Deployment beside the overlay.
    (tmp_path / "deploy" / "k8s").mkdir(parents=True)
    shutil.copy(PLAN_DIR.parent / "worker.yaml", tmp_path / "deploy" / "k8s" / "worker.yaml")
    result = CliRunner().invoke(plan_command, [*words, "--no-compare"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    emitted = {p.name: p.read_text() for p in (tmp_path / "deploy" / "k8s" / "plan").iterdir()}
    assert emitted == shipped, "deploy/k8s/plan differs from what its command emits: rerun the command in its header"


@pytest.mark.slow
def test_report_states_adapter_size_load_time_and_slot_pressure() -> None:
    from tools.capacity.plan import report

    text = report.markdown(_plan(lora_adapters=16))
    assert "16 LoRA adapters of rank 16" in text and "holds 414 MB and loads in 67 ms" in text
    assert "more adapters than slots" in text
    assert "more adapters than slots" not in report.markdown(_plan(lora_adapters=4))
