"""The plan prices a disaggregated fleet and chooses the topology (tools/capacity/plan/disagg.py, topology.py)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
from click.testing import CliRunner

from inferbus.timing import GB, KV_LINKS, kv_link, roofline
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.plan.disagg import DECODE_FIRST_TOKEN_STEPS, DecodeReplica, cheapest
from tools.capacity.plan.model import Assumptions, Slo, Workload
from tools.capacity.plan.planner import Plan, PlanInputs, make_plan
from tools.capacity.plan.topology import choose_topology, plan_topology
from tools.commands.plan import plan as plan_command


def _plan(mix: mix_mod.Mix, rate: float = 833.3, tps: tuple[int, ...] = (2, 4, 8), **kw: object) -> Plan:
    """Priced with each replica its own prefill queue, the arithmetic these tests check by hand (the
    default, pooled queues, is test_plan_pooled.py's)."""
    kw.setdefault("prefill_queue", "per-replica")
    inputs = PlanInputs(rate_rps=rate, rate_text=f"{rate} requests/s", workload=Workload.from_mix(mix),
                        mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5}, tps=list(tps), **kw)  # type: ignore[arg-type]
    return make_plan(inputs)


@pytest.fixture(scope="module")
def worked() -> Plan:
    return _plan(mix_mod.worked_example())


def _pair(plan: Plan, tp_p: int, tp_d: int):  # type: ignore[no-untyped-def]
    return next(r for r in plan.disaggregated if (r.tp_prefill, r.tp_decode) == (tp_p, tp_d))


@pytest.mark.slow
def test_the_transfer_time_is_the_p90_prompt_over_the_link(worked: Plan) -> None:
    row = _pair(worked, 4, 2)
    # The worked example's p90 prompt is 3,000 tokens (its 30% class), all of whose KV moves; the
    # side with fewer GPUs (decode TP2) sets the pace: 2 × 50 GB/s.
    assert row.transfer_tokens == 3000
    assert row.transfer_p90_s == pytest.approx(3000 * 163_840 / (2 * 50 * GB))
    assert row.link is KV_LINKS["rdma"]


@pytest.mark.slow
def test_the_prefill_gets_the_ttft_budget_less_the_transfer_and_a_decode_step(worked: Plan) -> None:
    slo = worked.inputs.slo
    for row in worked.disaggregated:
        if not row.feasible:
            continue
        assert row.decode_point is not None and row.prefill_point is not None
        share = slo.ttft_p90_s - row.transfer_p90_s - DECODE_FIRST_TOKEN_STEPS * row.decode_point.step_s
        assert row.prefill_budget_s == pytest.approx(share)
        # At the prefill's goodput its TTFT part fills the share, so the whole TTFT p90 meets the SLO
        # (and not by accident: within a percent of it).
        assert row.prefill_point.ttft_p90_s == pytest.approx(share, rel=1e-4)
        assert row.ttft_p90_s <= slo.ttft_p90_s + 1e-9
        assert row.ttft_p90_s > 0.99 * slo.ttft_p90_s


@pytest.mark.slow
def test_a_slow_link_costs_prefill_goodput(worked: Plan) -> None:
    slow = _plan(mix_mod.worked_example(), kv_link=kv_link("rdma", 0.5))  # 0.5 GB/s per GPU
    fast, crawl = _pair(worked, 4, 4), _pair(slow, 4, 4)
    assert crawl.transfer_p90_s == pytest.approx(fast.transfer_p90_s * 100)
    assert crawl.transfer_p90_s > 0.2
    assert crawl.prefill_budget_s == pytest.approx(fast.prefill_budget_s - (crawl.transfer_p90_s - fast.transfer_p90_s))
    assert crawl.prefill_rps < 0.9 * fast.prefill_rps
    assert crawl.prefill_replicas > fast.prefill_replicas
    # So slow that nothing is left for the prefill: infeasible, and said why.
    stuck = _plan(mix_mod.worked_example(), kv_link=kv_link("rdma", 0.05))
    row = _pair(stuck, 4, 4)
    assert not row.feasible and "KV transfer" in (row.infeasible or "")


def test_a_decode_replicas_kv_is_planned_at_its_p90_which_a_sampled_poisson_batch_reaches() -> None:
    """The KV a decode replica holds is a Poisson number of sequences (M/G/∞), each at a context
    that grows by one token a step: its p90 (the closed form's normal approximation, with the
    mix's second moments) against the p90 of batches drawn as that queue leaves them."""
    short, long_ = (2_000, 300), (14_000, 400)  # (input, output) tokens, half the requests each
    mix = mix_mod.from_spec({"name": "two", "classes": [
        {"name": "short", "weight": 1, "input_tokens": short[0], "output_tokens": short[1]},
        {"name": "long", "weight": 1, "input_tokens": long_[0], "output_tokens": long_[1]}]})
    w = Workload.from_mix(mix)
    # The time-weighted second moment by hand: ∫₀ᵒ (n + t)² dt over the mean output.
    by_hand = sum(n * n * o + n * o * o + o ** 3 / 3 for n, o in (short, long_)) / 2 / ((short[1] + long_[1]) / 2)
    assert w.decode_ctx_sq == pytest.approx(by_hand)
    assert w.input_sq == pytest.approx((short[0] ** 2 + long_[0] ** 2) / 2)
    model = roofline("H100", 2)
    replica = DecodeReplica(model, model.kv_capacity_tokens(), w, Assumptions(), hold_s=0.8)
    rate = 2.0
    point = replica.at(rate)
    rng = random.Random(7)
    samples = []
    for _ in range(20_000):
        held = 0.0
        for n, o in (short, long_):
            for _ in range(poisson(rng, rate / 2 * o * point.step_s)):  # decoding, at a uniform age
                held += n + rng.random() * o
            held += n * poisson(rng, rate / 2 * 0.8)  # reserved, on their way in
        samples.append(held)
    samples.sort()
    sampled_p90 = samples[int(0.9 * len(samples))]
    planned_p90 = point.resident_tokens + point.reserved_tokens + point.spread_tokens
    assert planned_p90 == pytest.approx(sampled_p90, rel=0.03)
    # The mean alone would plan a tenth of the batches out of room.
    assert sum(s > point.resident_tokens + point.reserved_tokens for s in samples) > 0.3 * len(samples)


def poisson(rng: random.Random, mean: float) -> int:
    """Knuth's Poisson draw (means of a few dozen at most)."""
    limit, count, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        count += 1
        product *= rng.random()
    return count


@pytest.mark.slow
def test_the_decode_side_reserves_kv_for_prompts_in_flight() -> None:
    # The Mooncake conversation trace's long prompts on a decode TP2 replica: KV binds, and the
    # reservation (rate × mean prompt × the TTFT it is held for) is part of what binds.
    mix = mix_mod.load(traces.find("mooncake_conversation.jsonl"))
    plan = _plan(mix, rate=20.0)
    row = _pair(plan, 8, 2)
    point = row.decode_point
    assert point is not None and row.decode_binding == "KV"
    w = plan.inputs.workload
    assert point.reserved_tokens == pytest.approx(row.decode_rps * w.input_tokens * plan.inputs.slo.ttft_p90_s)
    assert point.reserved_tokens > 0.03 * row.decode_kv_capacity_tokens
    assert point.kv_fraction == pytest.approx((point.resident_tokens + point.reserved_tokens + point.spread_tokens)
                                              / row.decode_kv_capacity_tokens)
    assert point.kv_fraction == pytest.approx(plan.inputs.assumptions.kv_limit, rel=1e-3)
    # A few dozen long contexts per replica: the p90 lies well above the mean.
    assert point.spread_tokens > 0.15 * (point.resident_tokens + point.reserved_tokens)
    # Held for less time, less is reserved and more fits.
    model = roofline("H100", 2)
    shorter = DecodeReplica(model, model.kv_capacity_tokens(), w, Assumptions(), hold_s=0.1)
    assert shorter.limits(plan.inputs.slo)["KV"] > row.decode_rps * 1.02


def test_decode_replicas_run_decode_only_steps(worked: Plan) -> None:
    row = _pair(worked, 4, 4)
    point = row.decode_point
    assert point is not None and row.decode_binding == "TPOT"
    # No chunk steps: the step is T(B, S, 0, 0) and TPOT p90 is that step, at the SLO.
    model = roofline("H100", 4)
    assert point.step_s == pytest.approx(model.step_time(point.batch, point.resident_tokens), rel=1e-6)  # type: ignore[arg-type]
    assert point.tpot_p90_s == pytest.approx(worked.inputs.slo.tpot_p90_s, rel=1e-4)
    # The aggregated TP4 replica at the same TPOT carries prefill chunks, so its batch is smaller.
    agg = next(r for r in worked.rows if r.tp == 4)
    assert agg.point is not None and agg.point.decode_batch < 0.6 * point.batch


@pytest.mark.slow
def test_the_fleet_arithmetic(worked: Plan) -> None:
    row = cheapest(worked.disaggregated)
    assert row is not None
    rate, headroom = worked.inputs.rate_rps, worked.inputs.headroom
    assert row.prefill_replicas == math.ceil(rate / row.prefill_rps * (1 + headroom))
    assert row.decode_replicas == math.ceil(rate / row.decode_rps * (1 + headroom))
    # A small pool keeps a spare replica beyond its bare need (N+1), which 15% headroom would not give.
    small = _plan(mix_mod.load(traces.find("mooncake_synthetic.jsonl")), rate=20.0)
    pair = _pair(small, 8, 4)
    assert pair.decode_replicas == math.ceil(20.0 / pair.decode_rps) + 1
    assert pair.decode_replicas > math.ceil(20.0 / pair.decode_rps * 1.15)
    assert row.gpus == row.prefill_replicas * row.tp_prefill + row.decode_replicas * row.tp_decode
    assert row.usd_per_hour == row.gpus_total * 2.5
    assert all(row.usd_per_hour <= r.usd_per_hour for r in worked.disaggregated if r.feasible)


def test_the_worked_example_priced_per_replica_disaggregates_by_a_little(worked: Plan) -> None:
    choice = plan_topology(worked)
    assert choice.topology == "disaggregated"
    assert choice.disaggregated is not None and choice.disaggregated.name == "H100 prefill TP8 + decode TP4"
    assert (choice.disaggregated.gpus_total, choice.aggregated.gpus_total) == (508, 516)  # type: ignore[union-attr]
    assert "costs 2% less" in choice.reason and "binds on TPOT" in choice.reason


@pytest.mark.slow
def test_a_long_prompt_mix_stays_aggregated_and_says_so() -> None:
    # Mooncake synthetic: 15k-token prompts, 149-token answers. Decode is nearly free beside prefill,
    # so splitting it off only takes a decode step and the transfer out of the TTFT budget.
    plan = _plan(mix_mod.load(traces.find("mooncake_synthetic.jsonl")), rate=20.0)
    choice = plan_topology(plan)
    assert choice.topology == "aggregated"
    assert "is cheaper for this mix" in choice.reason
    assert choice.gain < 1


def test_choose_topology_ranks_by_dollars_and_ties_go_aggregated(worked: Plan) -> None:
    agg, dis = worked.cheapest, cheapest(worked.disaggregated)
    assert agg is not None and dis is not None
    assert choose_topology(agg, dis).topology == "disaggregated"
    dearer = replace(dis, usd_per_gpu_hour=3.0)
    assert choose_topology(agg, dearer).topology == "aggregated"
    assert choose_topology(None, dis).topology == "disaggregated"
    assert choose_topology(agg, None).topology == "aggregated"
    none = choose_topology(None, None)
    assert none.topology == "none" and math.isnan(none.gain)
    infeasible = replace(dis, infeasible="no")
    assert "no disaggregated pair holds the SLO (no)" in choose_topology(agg, infeasible).reason


def test_choose_topology_breaks_an_exact_tie_for_aggregated(worked: Plan) -> None:
    agg, dis = worked.cheapest, cheapest(worked.disaggregated)
    assert agg is not None and dis is not None and agg.cost is not None
    # Same $/hour and GPUs (516 = 68 × TP4 + 61 × TP4 against 129 × TP4): aggregated, one pool to run.
    twin = replace(dis, tp_prefill=4, tp_decode=4, prefill_replicas=68, decode_replicas=61)
    assert (twin.gpus_total, twin.usd_per_hour) == (agg.gpus_total, agg.cost.usd_per_hour)
    tie = choose_topology(agg, twin)
    assert tie.topology == "aggregated" and "disaggregated costs the same" in tie.reason
    cheaper_by_a_gpu = replace(dis, decode_replicas=dis.decode_replicas - 1)
    assert choose_topology(agg, cheaper_by_a_gpu).topology == "disaggregated"


@pytest.mark.slow
def test_plan_command_reports_the_topology(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    result = runner.invoke(plan_command, ["--rpm", "50000", "--tp", "4,8", "--gpu", "H100:2.5", "--no-compare",
                                          "--kv-link", "nvlink", "--out", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "Topology: disaggregated" in result.output
    data = json.loads((tmp_path / "plan.json").read_text())
    topology = data["topology"]
    assert topology["chosen"] == "disaggregated"
    pair = next(p for p in topology["disaggregated"] if p["config"] == "H100 prefill TP8 + decode TP4")
    assert pair["kv_link"] == "nvlink" and pair["kv_link_gb_s_per_gpu"] == 450
    assert (pair["decode_replicas"], pair["decode_replicas_set_by"]) == (61, "headroom")
    assert pair["transfer_p90_s"] == pytest.approx(3000 * 163_840 / (4 * 450 * GB))
    text = (tmp_path / "plan.md").read_text()
    assert "## Topology: aggregated or disaggregated" in text and "nvlink, 450 GB/s per GPU one way" in text
    assert "R = λ_d × n × h" in text
    assert ("decode replicas = max(⌈833.33 ÷ 15.821 × 1.15⌉, ⌈833.33 ÷ 15.821 × 1.1 × 1.025⌉ + 1) = "
            "max(⌈60.57⌉, ⌈59.39⌉ + 1) = 61 × TP4 = 244 GPUs") in text


@pytest.mark.parametrize("value", ["ethernet", "rdma:fast", "rdma:0"])
def test_plan_command_refuses_a_bad_link(value: str) -> None:
    result = CliRunner().invoke(plan_command, ["--rpm", "100", "--kv-link", value, "--no-compare"])
    assert result.exit_code == 2
    assert "--kv-link" in result.output


@pytest.mark.slow
def test_no_disagg_prices_aggregated_only() -> None:
    result = CliRunner().invoke(plan_command, ["--rpm", "50000", "--tp", "4", "--gpu", "H100:2.5", "--no-compare",
                                               "--no-disagg", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["topology"] is None
