"""`inferbus plan`: the worked example, constraints, sweeps, warm pool, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from inferbus.timing import roofline
from tools.capacity import mix
from tools.capacity.plan import sweep_table
from tools.capacity.plan.costs import fleet_cost
from tools.capacity.plan.model import Assumptions, ReplicaModel, Slo, Workload
from tools.capacity.plan.planner import PlanInputs, make_plan
from tools.capacity.plan.warm_pool import Ramp, ramp_from_arrivals, warm_pool
from tools.commands.main import main

WORKED = mix.load("worked-example")
WORKLOAD = Workload.from_mix(WORKED)


def _inputs(**overrides) -> PlanInputs:  # type: ignore[no-untyped-def]
    base = dict(rate_rps=833.0, rate_text="833 requests/s", workload=WORKLOAD, mix=WORKED.describe(), slo=Slo(),
                gpu_prices={"H100": 2.5, "H200": 3.5}, tps=[2])
    base.update(overrides)
    return PlanInputs(**base)  # type: ignore[arg-type]


def _replica(gpu: str = "H100", tp: int = 2, **assumptions) -> ReplicaModel:  # type: ignore[no-untyped-def]
    model = roofline(gpu, tp)
    return ReplicaModel(model, model.kv_capacity_tokens(), WORKLOAD, Assumptions(**assumptions))


# ---- the worked example -------------------------------------------------------------------

@pytest.mark.slow
def test_worked_example_prices_prefill_in_whole_chunks() -> None:
    rows = {row.name: row for row in make_plan(_inputs()).rows}
    h100, h200 = rows["H100 TP2"], rows["H200 TP2"]
    # The hand estimate prices the mean prefill per step (≈ 4.1 req/s, 464 GPUs on H100 TP2; 4.7 and 412 on
    # H200 TP2). Prefill runs in whole chunks, compute-bound steps among memory-bound decode steps,
    # so the mean step is longer and the goodput lower: 3.07 and 4.03 req/s.
    assert h100.goodput_rps == pytest.approx(3.071, rel=1e-3)
    assert h100.replicas == 312 and h100.gpus == 624  # ⌈833 ÷ 3.0709 × 1.15⌉ = ⌈311.9⌉
    assert h200.goodput_rps == pytest.approx(4.034, rel=1e-3)
    assert h100.cost is not None and h200.cost is not None
    out_mtok_h = 833.0 * WORKLOAD.output_tokens * 3600 / 1e6
    assert h100.cost.usd_per_1m_output_all_in == pytest.approx(h100.gpus * 2.5 / out_mtok_h)
    assert h100.source == h200.source == "model"
    assert h100.binding == h200.binding == "TPOT"


def test_pricing_the_mean_prefill_per_step_reproduces_the_hand_estimate() -> None:
    """The hand estimate's arithmetic (one step with λ·u·t prefill tokens, TPOT p90 = 1.15 × t) gives its 4.1 req/s."""
    replica, lam = _replica(), 4.1147
    o, u = WORKLOAD.output_tokens, WORKLOAD.uncached_tokens
    step = 0.02
    for _ in range(200):
        batch = lam * o * step
        step = replica.step_model.step_time(
            batch,
            batch * WORKLOAD.decode_ctx_tokens,
            lam * u * step,  # type: ignore[arg-type]
            WORKLOAD.prefill_ctx_tokens,
        )
    assert 1.15 * step == pytest.approx(0.040, rel=1e-3)
    # The whole-chunk model at the same rate: a longer mean step, over the SLO.
    assert replica.at(lam).step_s > 1.2 * step and replica.at(lam).tpot_p90_s > 0.040


def test_worked_example_moments_and_the_1500_token_ttft_prompt() -> None:
    assert WORKLOAD.uncached_tokens == pytest.approx(1314)
    # 60% prefill 240 tokens, 30% 1,500, 10% 7,200: the 90th-percentile request prefills 1,500.
    assert WORKLOAD.ttft_tokens == 1500 and WORKLOAD.ttft_tokens_derived
    assert WORKED.uncached_quantile(0.5) == 240
    assert WORKED.uncached_quantile(0.95) == 7200
    assert Workload.from_mix(WORKED, ttft_tokens=2000).ttft_tokens == 2000


def test_steady_state_matches_the_formulas() -> None:
    replica = _replica()
    point = replica.at(4.0)
    o, u = WORKLOAD.output_tokens, WORKLOAD.uncached_tokens
    assert point.decode_batch == pytest.approx(4.0 * o * point.step_s)
    assert point.prefill_tokens_per_step == pytest.approx(4.0 * u * point.step_s)
    share = 4.0 * u * point.step_s / 2048
    assert point.chunk_step_share == pytest.approx(share)
    decode = replica.step_model.step_time(point.decode_batch, point.resident_ctx_tokens, 0, 0.0)
    full = replica.step_model.step_time(
        point.decode_batch, point.resident_ctx_tokens, 2048, WORKLOAD.prefill_ctx_tokens
    )
    assert (point.decode_only_step_s, point.full_chunk_step_s) == (pytest.approx(decode), pytest.approx(full))
    assert point.step_s == pytest.approx(share * full + (1 - share) * decode, rel=1e-6)
    mu = 2048 / point.full_chunk_step_s
    wait = 4.0 * WORKLOAD.uncached_sq / mu**2 / (2 * (1 - 4.0 * u / mu))
    assert point.ttft_p90_s == pytest.approx(1500 / mu + math.log(10) * wait + 2 * point.step_s)
    spread = (full - decode) * math.sqrt(share * (1 - share) / o)
    assert point.tpot_spread_s == pytest.approx(spread)
    assert point.tpot_p90_s == pytest.approx(point.step_s + 1.2815516 * spread)


# ---- which constraint binds ------------------------------------------------------------------

def test_binding_constraint_is_at_its_target_and_is_the_smallest_limit() -> None:
    replica = _replica()
    goodput = replica.goodput(Slo())
    assert goodput.binding == "TPOT"
    assert goodput.point is not None and goodput.point.tpot_p90_s == pytest.approx(0.040, rel=1e-4)
    assert goodput.rps == min(goodput.limits[c] for c in ("TTFT", "TPOT", "KV"))
    below, above = replica.at(goodput.rps * 0.99), replica.at(goodput.rps * 1.01)
    assert all(below.meets(c, Slo(), 0.9) for c in ("TTFT", "TPOT", "KV"))
    assert not above.meets("TPOT", Slo(), 0.9)


def test_tight_ttft_binds_ttft_and_small_kv_limit_binds_kv() -> None:
    ttft = _replica().goodput(Slo(ttft_p90_s=0.3, tpot_p90_s=0.040))
    assert ttft.binding == "TTFT" and ttft.point is not None
    assert ttft.point.ttft_p90_s == pytest.approx(0.3, rel=1e-4)
    kv = _replica(kv_limit=0.2).goodput(Slo())
    assert kv.binding == "KV" and kv.point is not None
    assert kv.point.kv_fraction == pytest.approx(0.2, rel=1e-4)
    assert kv.rps < ttft.limits["TPOT"]


# ---- infeasible configurations ---------------------------------------------------------------

@pytest.mark.slow
def test_a_config_that_cannot_hold_the_model_is_infeasible_not_a_crash() -> None:
    plan = make_plan(_inputs(tps=[1, 2]))
    rows = {row.name: row for row in plan.rows}
    h100_tp1 = rows["H100 TP1"]
    assert not h100_tp1.feasible and "no room for a KV cache" in str(h100_tp1.infeasible)
    assert "70.6 GB" in str(h100_tp1.infeasible)
    assert rows["H200 TP1"].feasible  # 141 GB holds the weights
    assert plan.cheapest is rows["H100 TP2"]


@pytest.mark.slow
def test_an_slo_no_replica_can_meet_is_reported_per_row() -> None:
    plan = make_plan(_inputs(slo=Slo(ttft_p90_s=0.8, tpot_p90_s=0.010)))
    assert plan.cheapest is None
    for row in plan.rows:
        assert not row.feasible and "even an idle replica misses TPOT" in str(row.infeasible)


# ---- costs and the warm pool, by hand ---------------------------------------------------------

def test_costs_by_hand() -> None:
    cost = fleet_cost(rate_rps=100.0, workload=WORKLOAD, replica_rps=5.0, replicas=23, tp=2, usd_per_gpu_hour=3.0,
                      prefill_share=0.25)
    assert cost.gpus == 46 and cost.usd_per_hour == pytest.approx(138.0)
    out_mtok = 100 * 330 * 3600 / 1e6  # 118.8 M output tokens an hour
    assert cost.usd_per_1m_output_all_in == pytest.approx(138.0 / out_mtok)
    # The serving fleet's form: $/GPU-h × 1e6 / (3600 × tok/s per GPU × utilisation).
    per_gpu, utilisation = 5.0 * 330 / 2, 100 / (23 * 5.0)
    assert cost.usd_per_1m_output_all_in == pytest.approx(3.0 * 1e6 / (3600 * per_gpu * utilisation))
    assert cost.usd_per_1m_output == pytest.approx(138.0 * 0.75 / out_mtok)
    assert cost.usd_per_1m_input == pytest.approx(138.0 * 0.25 / (100 * 2060 * 3600 / 1e6))


def test_warm_pool_by_hand() -> None:
    # 120 req/s per minute = 2 req/s per second; over a 120 s cold start the rate rises 240 req/s;
    # at 4 req/s per replica that is 60 warm replicas, 120 GPUs at TP2.
    pool = warm_pool(ramp_rps_per_s=2.0, cold_start_s=120, warm_start_s=5, replica_rps=4.0, tp=2, replicas=250,
                     rate_rps=833.0)
    assert (pool.rise_rps, pool.replicas, pool.gpus) == (240.0, 60, 120)
    assert pool.warm_start_rise_rps == 10.0 and pool.headroom_rps == pytest.approx(167.0)
    assert pool.covered_by_headroom
    assert warm_pool(ramp_rps_per_s=2.0, cold_start_s=121, warm_start_s=5, replica_rps=4.0, tp=2, replicas=250,
                     rate_rps=833.0).replicas == 61


def test_ramp_from_a_trace_scales_to_the_planned_peak() -> None:
    # Whole minutes at 1, 1, 2, 4, 3 req/s (and a partial sixth minute that is ignored).
    arrivals: list[float] = []
    for minute, rate in enumerate([1, 1, 2, 4, 3]):
        arrivals += [minute * 60 + i * 60 / (rate * 60) for i in range(rate * 60)]
    arrivals += [300.0, 310.0]
    ramp = ramp_from_arrivals(arrivals, planned_rps=400.0, window_s=120)
    assert ramp.minutes == 5 and ramp.trace_peak_rps == pytest.approx(4.0) and ramp.scale == pytest.approx(100.0)
    # Steepest rise within two minutes: minute 1 → 3, 1 → 4 req/s, × 100 = 300 req/s.
    assert (ramp.from_minute, ramp.to_minute) == (1, 3)
    assert ramp.rise_rps == pytest.approx(300.0) and ramp.ramp_rps_per_s == pytest.approx(2.5)
    # A one-minute window sees only one minute's rise: 2 → 4 req/s.
    assert ramp_from_arrivals(arrivals, 400.0, 60).rise_rps == pytest.approx(200.0)


@pytest.mark.slow
def test_plan_rows_carry_the_warm_pool() -> None:
    row = make_plan(_inputs(ramp=Ramp(2.0, "given"))).rows[0]
    assert row.warm is not None
    assert row.warm.replicas == math.ceil(240 / row.goodput_rps)


# ---- measured sweep tables ---------------------------------------------------------------------

def _step(concurrency: int, rps: float, ttft: float, tpot: float, *, limited: bool = False, errors: int = 0) -> dict:  # type: ignore[type-arg]
    def lat(p90: float) -> dict:  # type: ignore[type-arg]
        return {"mean": p90 * 0.8, "p50": p90 * 0.7, "p90": p90, "p99": p90 * 1.3}

    return {"concurrency": concurrency, "rate_rps": None, "duration_s": 60, "requests": 200, "completed": 200 - errors,
            "errors": errors, "request_rps": rps, "input_tok_s": rps * 2060, "output_tok_s": rps * 330,
            "ttft_s": lat(ttft), "tpot_s": lat(tpot), "itl_s": lat(tpot), "e2e_s": lat(ttft + 330 * tpot),
            "slo_attainment": 0.95, "slo_met": True, "goodput_rps": rps, "client_limited": limited}


def _sweep(hardware: dict | None = None, mix_desc: dict | None = None, steps: list | None = None) -> dict:  # type: ignore[type-arg]
    return {
        "schema": "inferbus.capacity.sweep/v1",
        "model": "llama",
        "mix": mix_desc if mix_desc is not None else WORKED.describe(),
        "slo": {"ttft_p90_s": 2.0, "tpot_p90_s": 0.1},  # the sweep's own, looser SLO: the planner re-judges
        "hardware": hardware if hardware is not None else {"gpu": "H100", "tp": 2, "replicas": 2},
        "mode": "concurrency",
        "steps": steps
        if steps is not None
        else [
            _step(8, 2.0, 0.20, 0.020),
            _step(16, 4.0, 0.40, 0.030),
            _step(32, 6.0, 0.60, 0.050),
            _step(64, 6.5, 3.00, 0.090),
        ],
    }


def test_sweep_goodput_rejudges_interpolates_and_divides_by_replicas() -> None:
    sweep = sweep_table.parse(_sweep(), "fixture.json")
    result = sweep_table.goodput(sweep, Slo(), WORKED.describe())
    # Best passing step 4 req/s (TPOT 30 ms); next step 6 req/s fails TPOT (50 ms): 40 ms is halfway,
    # so 5 req/s over two replicas = 2.5 per replica.
    assert result.binding == "TPOT"
    assert result.rps == pytest.approx(2.5)
    assert (result.passing_rps, result.failing_rps) == (2.0, 3.0)
    assert result.warnings == ()


@pytest.mark.slow
def test_sweep_replaces_the_model_row_and_warns() -> None:
    other_mix = {**WORKED.describe(), "mean_input_tokens": 1000.0}
    data = _sweep(mix_desc=other_mix, steps=[_step(8, 2.0, 0.2, 0.02, limited=True), _step(16, 4.0, 0.4, 0.03)])
    result = sweep_table.goodput(sweep_table.parse(data, "fixture.json"), Slo(), WORKED.describe())
    text = " ".join(result.warnings)
    assert "mean_input_tokens" in text and "load generator" in text and "lower bound" in text
    assert result.rps == pytest.approx(2.0) and result.binding is None
    plan = make_plan(_inputs(tps=[2, 4]), [result])
    rows = {row.name: row for row in plan.rows}
    assert rows["H100 TP2"].source == "sweep" and rows["H100 TP4"].source == "model"
    assert rows["H100 TP2"].replicas == math.ceil(833 / 2.0 * 1.15)
    assert rows["H100 TP2"].model_goodput.rps == pytest.approx(3.071, rel=0.01)  # kept for comparison


def test_sweep_edge_cases() -> None:
    failing = _sweep(steps=[_step(8, 2.0, 0.9, 0.02)])
    assert sweep_table.goodput(sweep_table.parse(failing, "f"), Slo(), {}).infeasible == "no sweep step met the SLO"
    errors = _sweep(steps=[_step(8, 2.0, 0.2, 0.02), _step(16, 4.0, 0.3, 0.03, errors=20)])
    result = sweep_table.goodput(sweep_table.parse(errors, "f"), Slo(), WORKED.describe())
    assert result.binding == "errors" and result.rps == pytest.approx(1.0)
    no_hw = sweep_table.parse(_sweep(hardware={}), "f.json")
    with pytest.raises(sweep_table.SweepError, match="GPU:TP=PATH"):
        sweep_table.goodput(no_hw, Slo(), {})
    assert sweep_table.parse(_sweep(hardware={}), "f.json", "H200", 4).tp == 4
    with pytest.raises(sweep_table.SweepError, match="no `steps`"):
        sweep_table.parse({"schema": "inferbus.capacity.sweep/v1", "steps": []}, "f.json")
    nan = _step(8, 0.0, float("nan"), float("nan"))
    nan["completed"] = 0
    assert "TTFT" in sweep_table.parse(_sweep(steps=[nan]), "f").steps[0].failures(Slo())


# ---- the command line --------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    sweep_path = tmp_path / "sweep.json"
    sweep_path.write_text(json.dumps(_sweep(hardware={"replicas": 2})))
    out = tmp_path / "plan"
    result = CliRunner().invoke(main, [
        "plan", "--rpm", "50000", "--tp", "1,2", "--gpu", "H100:2.50,H200:3.50", "--sweep", f"H200:2={sweep_path}",
        "--ramp", "120", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "H100 TP2" in result.output and "Cheapest: H100 TP2" in result.output
    for name in ("plan.md", "plan.json", "fleet.png", "latency.png"):
        assert (out / name).stat().st_size > 0
    text = (out / "plan.md").read_text()
    assert "The arithmetic, row by row" in text
    assert ("max(⌈833.33 ÷ 3.071 × 1.15⌉, ⌈833.33 ÷ 3.071 × 1.1 × 1.025⌉ + 1) = max(⌈312.07⌉, ⌈305.96⌉ + 1) = 313 "
            "**serving**") in text
    assert "H100 TP1 — infeasible" in text and "measured sweep" in text
    # The TPOT line a reader can check by hand: 0.0735 × 172.93 + 0.9265 × 26.55 = 37.31 ms;
    # 146.39 × √(0.0735 × 0.9265 ÷ 330) = 2.10 ms; 37.31 + 1.2816 × 2.10 = 40.0 ms.
    assert "mean step t = f × t_f + (1 − f) × t_d = 0.0735 × 172.93 ms + 0.9265 × 26.55 ms = 37.31 ms" in text
    assert "TPOT p90 = t + 1.2816 × σ = 37.31 ms + 2.69 ms = **40.0 ms**" in text
    data = json.loads((out / "plan.json").read_text())
    rows = {row["config"]: row for row in data["rows"]}
    assert data["schema"] == "inferbus.plan/v1" and data["cheapest"] == "H100 TP2"
    assert rows["H200 TP2"]["goodput_source"] == "sweep" and rows["H200 TP2"]["goodput_rps_per_replica"] == 2.5
    assert rows["H100 TP2"]["gpus"] == 626 and rows["H100 TP2"]["warm_pool"]["replicas"] == 79  # ⌈2 × 120 ÷ 3.0709⌉
    assert rows["H100 TP1"]["feasible"] is False


@pytest.mark.slow
def test_cli_json_output_and_ramp_trace(tmp_path: Path) -> None:
    # Five minutes at 0.5 req/s, then five at 1 req/s: scaled so 1 req/s is the planned 100 req/s,
    # the load rises 50 req/s within one 120 s cold start.
    arrivals = [2.0 * i for i in range(150)] + [300.0 + i for i in range(301)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t * 1000, "input_length": 100, "output_length": 10}) + "\n"
                             for t in arrivals))
    result = CliRunner().invoke(main, ["plan", "--rps", "100", "--tp", "2", "--gpu", "H100:2", "--json",
                                       "--ramp-trace", str(trace)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    ramp = data["inputs"]["ramp"]["trace"]
    assert ramp["scale"] == pytest.approx(100.0) and ramp["rise_rps"] == pytest.approx(50.0)
    row = data["rows"][0]
    assert row["warm_pool"]["replicas"] == math.ceil(50.0 / row["goodput_rps_per_replica"])


@pytest.mark.parametrize("args, message", [
    (["--rpm", "1000", "--gpu", "A100:2"], "unknown GPU 'A100'; known: H100, H200"),
    (["--rpm", "1000", "--gpu", "H100"], "needs a price"),
    (["--gpu", "H100:2"], "exactly one of --rpm or --rps"),
    (["--rpm", "1000", "--rps", "10"], "exactly one of --rpm or --rps"),
    (["--rpm", "1000", "--tp", "3"], "TP must be among"),
    (["--rpm", "1000", "--slo", "ttft=800"], "ttft_p90_ms"),
    (["--rpm", "1000", "--slo", "tpot_p90_ms=40", "--tpot-p90-ms", "30"], "--slo says"),
    (["--rpm", "1000", "--mix", "nonesuch"], "no mix 'nonesuch'"),
    (["--rpm", "1000", "--sweep", "missing.json"], "cannot read missing.json"),
    (["--rpm", "1000", "--ramp", "10", "--ramp-trace", __file__], "not both"),
])
def test_bad_inputs_give_clear_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_sweep_without_hardware_asks_for_the_prefix(tmp_path: Path) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(_sweep(hardware={})))
    result = CliRunner().invoke(main, ["plan", "--rpm", "1000", "--sweep", str(path)])
    assert result.exit_code == 2 and "--sweep H100:2=" in result.output
