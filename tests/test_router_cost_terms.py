"""Each term of the affinity router's cost, checked where it is computed (`registry.set_base_cost`
and `AffinityPolicy.choose`), from the bus events that feed it: its value in seconds, and that a
placement follows it when the workers differ in that term alone."""

from __future__ import annotations

import random

import pytest

from proto import messages as m
from services.router.config import RoutingConfig
from services.router.placement import Placer, make_placer
from services.router.registry import WorkerView, set_base_cost, share_cost

# Round numbers: 10,000 prefill tokens per second, a full engine of decoding costs 0.25 s, each KV
# token held 0.1 of a prefill token; the share term is off unless a test turns it on.
CONFIG = RoutingConfig(prefill_tokens_per_s=10_000.0, decode_weight_s=0.25, active_kv_weight=0.1, miss_weight=5.0,
                       share_weight_s=0.0, temperature=0.001)


def beat(worker_id: str) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=0, ts=0, max_running=10)


def load(worker_id: str, *, running: int = 0, waiting: int = 0, queued_prefill: int = 0, kv_used: int = 0,
         pulled_own: int = 0) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker_id, model="m", ts=0, seq=1, running=running, waiting=waiting,
                        in_flight=running, max_running=10, queued_prefill_tokens=queued_prefill,
                        kv_used_tokens=kv_used, kv_capacity_tokens=1_000_000, pulled_own=pulled_own)


def placer(seed: int = 1, config: RoutingConfig = CONFIG, **loads: m.WorkerLoad) -> Placer:
    router = make_placer("affinity", lambda: 100.0, config, random.Random(seed))
    for worker_id, report in loads.items():
        router.registry.on_heartbeat(beat(worker_id))
        router.registry.on_load(report)
    return router


def cost(router: Placer, worker_id: str) -> float:
    return router.registry.workers[worker_id].base_cost


def ask(tokens: int = 10, hashes: list[int] | None = None) -> m.PlacementRequest:
    return m.PlacementRequest(request_id="r", model="m", prompt_tokens=tokens, block_hashes=hashes or [],
                              block_size=64 if hashes else 0)


def test_an_idle_worker_costs_nothing() -> None:
    assert cost(placer(a=load("a")), "a") == 0.0


def test_queued_prefill_costs_its_tokens_at_the_prefill_rate() -> None:
    assert cost(placer(a=load("a", queued_prefill=5_000)), "a") == pytest.approx(0.5)


def test_kv_held_by_running_requests_costs_its_weight_per_token() -> None:
    assert cost(placer(a=load("a", kv_used=40_000)), "a") == pytest.approx(0.1 * 40_000 / 10_000)


def test_running_and_waiting_requests_cost_the_decode_weight_per_slot() -> None:
    assert cost(placer(a=load("a", running=4, waiting=1)), "a") == pytest.approx(0.25 * 5 / 10)


def test_placements_not_yet_pulled_cost_their_prefill_and_a_slot_each() -> None:
    router = placer(a=load("a"))
    view = router.registry.workers["a"]
    router.registry.count(view, 3_000, [])
    router.registry.count(view, 1_000, [])
    assert view.backlog() == 2
    assert cost(router, "a") == pytest.approx(4_000 / 10_000 + 0.25 * 2 / 10)
    router.registry.on_load(load("a", running=2, pulled_own=2))  # pulled: now the engine's load only
    assert view.backlog() == 0
    assert cost(router, "a") == pytest.approx(0.25 * 2 / 10)


def test_the_terms_add_up() -> None:
    router = placer(a=load("a", running=3, waiting=2, queued_prefill=2_000, kv_used=30_000))
    assert cost(router, "a") == pytest.approx(2_000 / 10_000 + 0.1 * 30_000 / 10_000 + 0.25 * 5 / 10)


def test_a_share_of_recent_traffic_above_the_mean_adds_the_share_cost() -> None:
    config = RoutingConfig(prefill_tokens_per_s=10_000.0, share_weight_s=1.0, share_limit=0.15)
    view = WorkerView("a", "m", 0.0, max_running=10, intake=1_075.0, intake_mean=1_000.0)
    set_base_cost(view, config)
    assert view.base_cost == pytest.approx(share_cost(0.075, config)) == pytest.approx(1.0)
    view.intake = 900.0  # below the mean: a bonus
    set_base_cost(view, config)
    assert view.base_cost == pytest.approx(-0.1 / 0.15)


@pytest.mark.parametrize("busier", [
    {"queued_prefill": 2_000},
    {"kv_used": 20_000},
    {"running": 3},
    {"waiting": 3},
], ids=["queued_prefill", "active_kv", "running", "waiting"])
def test_a_placement_avoids_the_worker_busier_in_one_term_alone(busier: dict[str, int]) -> None:
    # Each term alone is worth at least 0.075 s here, against a softmax temperature of 1 ms: with
    # the term counted the busier worker is never chosen; without it, half the time.
    picks = [placer(seed, a=load("a", **busier), b=load("b")).place(ask()).worker_id for seed in range(20)]
    assert picks == ["b"] * 20


def test_an_uncached_prompt_costs_the_miss_weight_per_token_where_it_is_not_cached() -> None:
    router = placer(a=load("a", queued_prefill=2_000), b=load("b"))
    hashes = [11, 12, 13]
    router.registry.on_cache(m.CacheEvent(worker_id="a", seq=1, ts=0, stored=[m.BlockStored(block_hashes=hashes)]))
    # 202 prompt tokens: on b all are missed (5 × 202 / 10,000 = 0.101 s); on a, 3 blocks of 64 are
    # cached (5 × 10 / 10,000 = 0.005 s) above its 0.2 s of queued prefill: b is cheaper.
    assert router.place(ask(202, hashes)).worker_id == "b"
    # Cheaper queued prefill on a (0.05 s): the cached prefix now wins it.
    router = placer(a=load("a", queued_prefill=500), b=load("b"))
    router.registry.on_cache(m.CacheEvent(worker_id="a", seq=1, ts=0, stored=[m.BlockStored(block_hashes=hashes)]))
    assert router.place(ask(202, hashes)).worker_id == "a"
