"""bench/pd.py's fleet arithmetic: splitting the same GPUs between the pools, the stressed fleets."""

from __future__ import annotations

import pytest

from bench.pd import chunk_of, decode_counts, describe, disaggregated_config, split, stressed, unbound_decode
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity.fleetsim.pd import PdConfig, Pool
from tools.capacity.plan.model import Slo, Workload
from tools.capacity.plan.planner import PlanInputs, make_plan


def _pair():  # type: ignore[no-untyped-def]
    mix = mix_mod.worked_example()
    plan = make_plan(PlanInputs(rate_rps=833.3, rate_text="", workload=Workload.from_mix(mix), mix=mix.describe(),
                                slo=Slo(), gpu_prices={"H100": 2.5}, tps=[4, 8]))
    return next(r for r in plan.disaggregated if (r.tp_prefill, r.tp_decode) == (8, 4))


@pytest.mark.slow
def test_split_keeps_the_plans_ratio_on_the_same_gpus() -> None:
    pair = _pair()  # 33 prefill TP8 + 61 decode TP4: 264 : 244 GPUs
    prefill, decode = split(pair, 120)
    assert prefill * 8 + decode * 4 <= 120
    assert (prefill, decode) == (8, 14)  # 64 : 56 GPUs, as 264 : 244
    assert split(pair, 12) == (1, 1)  # at least one of each


@pytest.mark.slow
def test_decode_counts_leave_room_for_a_prefill_replica() -> None:
    pair = _pair()
    counts = decode_counts(40, pair)
    assert counts[:4] == [1, 2, 3, 4] and counts == sorted(counts)
    assert all(40 - d * 4 >= 8 for d in counts) and counts[-1] == 6  # 1, 2, 3, 4, 6; 9 leaves no prefill


def test_stressed_scales_each_pool_and_takes_replicas_down() -> None:
    engine = EngineConfig(gpu="H100", tp=4)
    config = PdConfig(decode=Pool(10, engine), prefill=Pool(21, EngineConfig(gpu="H100", tp=8)))
    smaller = stressed(config, 0.9, 1)
    assert (smaller.prefill.replicas, smaller.decode.replicas) == (17, 8)  # type: ignore[union-attr]
    assert describe(smaller) == "17 prefill × TP8 + 8 decode × TP4"
    assert stressed(PdConfig(decode=Pool(1, engine)), 1.0, 1).decode.replicas == 1  # never below one


@pytest.mark.slow
def test_the_prefill_pools_chunk_is_its_own_and_the_ceiling_frees_only_the_decode_pool() -> None:
    pair = _pair()
    config = disaggregated_config(pair, 13, 4, 2048, 8192)
    assert config.prefill is not None
    assert (config.prefill.engine.chunked_prefill_size, config.decode.engine.chunked_prefill_size) == (8192, 2048)
    assert chunk_of(config) == 8192 and chunk_of(disaggregated_config(pair, 13, 4, 2048)) == 2048
    assert chunk_of(PdConfig(decode=Pool(15, EngineConfig(gpu="H100", tp=8, chunked_prefill_size=1024)))) == 1024
    free = unbound_decode(config)
    assert free.prefill == config.prefill and free.decode.replicas == 40 and free.decode.engine == config.decode.engine


def test_the_router_check_walks_down_to_the_smallest_fleet_that_holds() -> None:
    from bench.pd import production_router

    mix = mix_mod.worked_example()  # H100 TP2 holds about 3 req/s of it within the SLO
    config = PdConfig(decode=Pool(10, EngineConfig(gpu="H100", tp=2)))
    found = production_router(config, mix, [1.0], 10.0, 180.0, seed=0)
    assert set(found) == {"affinity", "least_loaded"}
    for check in found.values():
        planned, smallest = check["planned"], check["smallest_holding"]
        assert (planned["replicas"], planned["up"], planned["gpus_provisioned"]) == (10, 9, 20)
        assert check["right"] and smallest is not None
        # 11 req/s (10% over the peak) on replicas of about 3 req/s: four up at the least.
        assert 5 <= smallest["replicas"] < 10 and smallest["minute_attainment"] >= 0.99
        assert check["10% smaller"]["replicas"] == 9


def test_the_router_check_hears_load_as_often_as_the_router_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.pd import LOAD_INTERVAL_S
    from services.worker.settings import WorkerSettings

    monkeypatch.delenv("INFERBUS_LOAD_INTERVAL_S", raising=False)
    assert WorkerSettings().load_interval_s == LOAD_INTERVAL_S
