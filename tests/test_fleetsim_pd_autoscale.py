"""The disaggregated fleet simulator with each pool autoscaled by the autoscaler's own
`DisaggregatedPolicy` (tools/capacity/fleetsim/pd.py, services/autoscaler/simulated_pd.py)."""

from __future__ import annotations

import random

import pytest

from services.autoscaler.policy import PolicyConfig
from services.autoscaler.roles import RoleBounds, role_configs
from services.autoscaler.simulated_pd import PdPolicyController
from services.sim_engine.config import EngineConfig
from tools.capacity.fleetsim.pd import PdConfig, PdFleet, Pool

ENGINE = EngineConfig(gpu="H100", tp=2, chunked_prefill_size=2048)
# Goodputs so high that the capacity rule asks for the minimum: only each pool's own SLO signal
# can grow it.
BOUNDS = RoleBounds(goodput_rps=1000.0, max_serving=12, max_warm=0, max_replicas=12)
BASE = PolicyConfig(min_serving=1, min_warm=0, cold_start_s=20.0, warm_start_s=1.0, slo_cooldown_s=10.0,
                    headroom=0.0)


def _arrivals(rate: float, seconds: float, n_in: int, n_out: int, seed: int = 1) -> list[tuple[float, int, int, int]]:
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append((t, n_in, n_out, 0))
        t += rng.expovariate(rate)
    return out


def _run(arrivals: list[tuple[float, int, int, int]]) -> tuple[PdFleet, PdPolicyController]:
    controller = PdPolicyController(role_configs(BASE, prefill=BOUNDS, decode=BOUNDS, prefill_ttft_budget_s=0.6,
                                                 decode_kv_budget=0.9))
    fleet = PdFleet(PdConfig(decode=Pool(1, ENGINE), prefill=Pool(1, ENGINE)), arrivals, controller=controller,
                    cold_start_s=20.0, warm_start_s=1.0)
    fleet.run()
    return fleet, controller


def _peak(fleet: PdFleet, role: str) -> int:
    return max(int(row[f"{role}_serving"]) for row in fleet.pool_series)


def test_long_prompts_grow_the_prefill_pool_alone() -> None:
    # 6,000-token prompts and 4-token answers: prefill is the work, decode is nearly idle.
    fleet, controller = _run(_arrivals(4.0, 300.0, 6000, 4))
    assert _peak(fleet, "prefill") >= 6
    assert any(d.pool == "sim:prefill" and d.direction == "up" and "TTFT" in d.reason for d in controller.decisions)
    # The decode pool's own signal: the prompts' KV it reserves (6,000 tokens each) fills one
    # replica's cache, which takes one more; TTFT and the prefill queue add nothing to it.
    assert _peak(fleet, "decode") <= 2
    ups = [d for d in controller.decisions if d.pool == "sim:decode" and d.direction == "up"]
    assert all(d.reason.startswith("scale up") and "KV" in d.reason.split(";")[0] for d in ups)


def test_long_answers_grow_the_decode_pool_alone() -> None:
    # 100-token prompts and 1,500-token answers at a rate one TP2 decode replica cannot hold at 40 ms.
    fleet, controller = _run(_arrivals(6.0, 300.0, 100, 1500))
    assert _peak(fleet, "decode") >= 4
    assert _peak(fleet, "prefill") == 1
    assert any(d.pool == "sim:decode" and d.direction == "up" and "TPOT" in d.reason.split(";")[0]
               for d in controller.decisions)


def test_gpu_hours_count_every_replica_up() -> None:
    fleet, _ = _run(_arrivals(4.0, 120.0, 6000, 4))
    summary = fleet._summary()
    assert summary.completed == summary.requests
    static = PdFleet(PdConfig(decode=Pool(1, ENGINE), prefill=Pool(1, ENGINE)), _arrivals(4.0, 120.0, 6000, 4)).run()
    assert static.gpu_hours == static.gpus * static.duration_s / 3600
    # At least the two replicas it started with, for the whole run; more once the prefill pool grew.
    assert summary.gpu_hours > 2 * 2 * summary.duration_s / 3600


@pytest.mark.slow
def test_the_bench_follows_the_day_within_the_plans_bounds() -> None:
    from bench import pd_autoscale

    r = pd_autoscale.run(20.0, 1200.0, 60.0, seed=0)
    a, s = r["autoscaled"], r["static"]
    assert a["requests"] == s["requests"] and a["completed"] == a["requests"]
    # Both pools grew from the trough's replicas with the day, and never past the plan's.
    assert (
        a["prefill_serving_max"] > a["start_prefill_replicas"] or a["decode_serving_max"] > a["start_decode_replicas"]
    )
    assert (
        a["prefill_serving_max"] <= r["plan_prefill_replicas"] and a["decode_serving_max"] <= r["plan_decode_replicas"]
    )
    assert a["minute_attainment"] >= 0.95
