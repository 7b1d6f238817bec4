"""The adapter part of the router's cost: batch slots, the expected wait for one, and homes that
grow with an adapter's share of traffic and shrink when it falls."""

from __future__ import annotations

import random

import pytest

from proto import messages as m
from services.router.adapter_slots import AdapterConfig, AdapterSlots, harmonic
from services.router.config import RoutingConfig
from services.router.placement import make_placer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def workers(*ids: str, slots: int = 4, loaded: dict[str, set[str]] | None = None) -> list[tuple[str, int, frozenset[str]]]:
    loaded = loaded or {}
    return [(w, slots, frozenset(loaded.get(w, set()))) for w in ids]


def test_a_full_batch_costs_the_expected_wait_for_its_smallest_adapter_to_finish() -> None:
    slots = AdapterSlots(Clock(), AdapterConfig(slot_hold_s=2.0))
    slots.on_load("w", {"": 5, "a": 1, "b": 3, "c": 2})  # 4 distinct of 4 slots
    assert slots.slot_wait("w", "a", 4) == 0.0  # its adapter is in the batch already
    assert slots.slot_wait("w", "d", 4) == pytest.approx(2.0 * harmonic(1))
    slots.on_placed("w", "e")  # a placement since the report: one adapter already waits for a slot
    assert slots.slot_wait("w", "d", 4) == pytest.approx(2.0 * (harmonic(1) + 1))
    assert slots.slot_wait("w", "d", 8) == 0.0  # room in a bigger batch
    slots.on_load("w", {"": 5, "b": 3})  # the report supersedes the placements it now counts
    assert slots.slot_wait("w", "d", 4) == 0.0


def test_an_adapter_goes_where_it_is_loaded_and_a_tail_adapter_keeps_one_home() -> None:
    clock = Clock()
    slots = AdapterSlots(clock)
    for _ in range(200):
        slots.observe(None)  # mostly base-model traffic
    slots.observe("tail")
    pool = workers("w1", "w2", "w3", "w4", loaded={"w2": {"tail"}})
    costs = slots.costs("tail", pool)
    assert costs.index(min(costs)) == 1 and costs[0] == slots.config.load_s
    slots.on_placed("w2", "tail")
    assert slots.costs("tail", pool) == [slots.config.load_s, 0.0, slots.config.load_s, slots.config.load_s]


def test_a_hot_adapter_opens_more_homes_as_its_share_grows_and_releases_them_when_it_falls() -> None:
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(share_half_life_s=10.0, release_after_s=20.0))
    pool = workers("w1", "w2", "w3", "w4", loaded={"w1": {"hot"}})
    for _ in range(30):  # a third of the traffic: ceil(1/3 · 4 · 2) = 3 homes
        slots.observe("hot")
        for _ in range(2):
            slots.observe(None)
    assert slots.wanted_homes("hot", 4) == 3
    slots.on_placed("w1", "hot")
    # Homes open: other workers cost only `away_s` (not loaded yet), not a load.
    assert slots.costs("hot", pool) == [0.0, slots.config.away_s, slots.config.away_s, slots.config.away_s]
    slots.on_placed("w2", "hot")
    slots.on_placed("w3", "hot")
    assert set(slots.homes["hot"].workers) == {"w1", "w2", "w3"}
    assert slots.costs("hot", pool)[3] == slots.config.load_s  # full: the fourth is no home
    # Traffic moves away: after half-lives its share is small, and after the hold the homes shrink.
    for _ in range(6):
        clock.now += 10.0
        for _ in range(50):
            slots.observe(None)
        slots.on_placed("w1", "hot")  # w1 keeps being used
        slots.costs("hot", pool)
    assert slots.wanted_homes("hot", 4) == 1
    assert set(slots.homes["hot"].workers) == {"w1"}
    # A worker it is still loaded on is cheap, but not a home any more.
    assert slots.costs("hot", workers("w1", "w2", loaded={"w1": {"hot"}, "w2": {"hot"}})) == [0.0, slots.config.away_s]


def test_the_router_spreads_a_hot_adapter_and_avoids_full_batches() -> None:
    clock = Clock()
    policy = make_placer("affinity", clock, RoutingConfig(temperature=0.01), random.Random(3))
    for w in ("a", "b", "c", "d"):
        policy.registry.on_heartbeat(m.Heartbeat(worker_id=w, model="m", engine_url="", started=0, ts=0, max_running=64,
                                        max_adapters=4, adapters=["hot@1"] if w == "a" else []))
    for w in ("a", "b", "c", "d"):
        policy.registry.on_load(m.WorkerLoad(worker_id=w, model="m", ts=0, seq=1, running=0, waiting=0, in_flight=0,
                                    max_running=64, kv_used_tokens=0, kv_capacity_tokens=1000))
    chosen = []
    for i in range(200):
        adapter = "hot@1" if i % 2 else f"tail-{i}@1"
        chosen.append(policy.place(m.PlacementRequest(request_id=str(i), model="m", prompt_tokens=100,
                                                      adapter=adapter)).worker_id if adapter == "hot@1" else None)
        clock.now += 0.01
    hot_workers = {w for w in chosen if w}
    assert len(hot_workers) >= 3  # half the traffic: ceil(0.5 · 4 · 2) = 4 homes wanted
    # A worker whose batch is full of other adapters loses to one with a free slot.
    policy.registry.on_load(m.WorkerLoad(worker_id="a", model="m", ts=0, seq=2, running=4, waiting=0, in_flight=4, max_running=64,
                                kv_used_tokens=0, kv_capacity_tokens=1000, adapter_requests={"x": 1, "y": 1, "z": 1, "": 1}))
    picks = {policy.place(m.PlacementRequest(request_id="n", model="m", prompt_tokens=100, adapter="new@1")).worker_id
             for _ in range(20)}
    assert "a" not in picks


def test_an_adapter_whose_homes_are_crowded_takes_a_new_home_on_a_quieter_worker() -> None:
    clock = Clock()
    slots = AdapterSlots(clock)
    for _ in range(1000):
        slots.observe(None)
    slots.observe("tail")
    slots.on_placed("w1", "tail")  # its one home
    pool = workers("w1", "w2", "w3", loaded={"w1": {"tail"}})
    assert slots.costs("tail", pool)[1] == slots.config.load_s  # balanced fleet: it stays home
    for _ in range(60):  # w1 takes twice its share of the recent placements
        slots.on_placed("w1", None)
    for _ in range(15):
        slots.on_placed("w2", None)
        slots.on_placed("w3", None)
    costs = slots.costs("tail", pool)
    assert costs[0] > costs[1] and costs[1] == slots.config.away_s  # w2 may become a home; w1 pays for its excess
