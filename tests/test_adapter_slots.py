"""The adapter part of the router's cost: batch slots, the expected wait for one, and homes that
grow with an adapter's share of traffic and shrink when it falls."""

from __future__ import annotations

import math
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


def workers(
    *ids: str, slots: int = 4, loaded: dict[str, set[str]] | None = None
) -> list[tuple[str, int, frozenset[str]]]:
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
    cold = slots.config.away_s + 2 * slots.config.load_s  # not a home, a load first, and everyone's batches wait for it
    costs = slots.costs("tail", pool)
    assert costs.index(min(costs)) == 1 and costs[0] == pytest.approx(cold)
    slots.on_placed("w2", "tail")
    assert slots.costs("tail", pool) == pytest.approx([cold, 0.0, cold, cold])


def test_a_hot_adapter_opens_more_homes_as_its_share_grows_and_releases_them_when_it_falls() -> None:
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(share_half_life_s=10.0, release_after_s=20.0))
    pool = workers("w1", "w2", "w3", "w4", loaded={"w1": {"hot"}})
    for _ in range(30):  # a third of the traffic: ceil(1/3 · 4 · 2) = 3 homes
        slots.observe("hot")
        for _ in range(2):
            slots.observe(None)
    assert slots.wanted_homes("hot", 4) == 3
    assert AdapterSlots(clock).wanted_homes("hot", 4) == 1  # without traffic seen, no share to go by
    slots.on_placed("w1", "hot")
    # Homes open: other workers cost no `away_s`, only the load they would wait for (twice: the
    # request waits for it, and so do the batches it stops there).
    load = slots.config.load_s
    assert slots.costs("hot", pool) == pytest.approx([0.0, 2 * load, 2 * load, 2 * load])
    slots.on_placed("w2", "hot")
    slots.on_placed("w3", "hot")
    assert set(slots.homes["hot"].workers) == {"w1", "w2", "w3"}
    assert slots.costs("hot", pool)[3] == pytest.approx(slots.config.away_s + 2 * load)  # full: the fourth is no home
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
    loaded = {"a": ["hot@1"], "b": [], "c": [], "d": []}
    for i in range(200):
        adapter = "hot@1" if i % 2 else f"tail-{i}@1"
        request = m.PlacementRequest(request_id=str(i), model="m", prompt_tokens=100, adapter=adapter)
        chosen.append(policy.place(request).worker_id if adapter == "hot@1" else None)
        warmed = policy.warm_target(request) if adapter == "hot@1" else None
        if warmed:  # the worker loads it in the background, and its next heartbeat lists it
            loaded[warmed].append("hot@1")
            policy.registry.on_heartbeat(m.Heartbeat(worker_id=warmed, model="m", engine_url="", started=0, ts=0,
                                                     max_running=64, max_adapters=4, adapters=loaded[warmed]))
        clock.now += 0.01
    hot_workers = {w for w in chosen if w}
    assert len(hot_workers) >= 3  # half the traffic: ceil(0.5 · 4 · 2) = 4 homes wanted
    # A worker whose batch is full of other adapters loses to one with a free slot.
    policy.registry.on_load(
        m.WorkerLoad(
            worker_id="a",
            model="m",
            ts=0,
            seq=2,
            running=4,
            waiting=0,
            in_flight=4,
            max_running=64,
            kv_used_tokens=0,
            kv_capacity_tokens=1000,
            adapter_requests={"x": 1, "y": 1, "z": 1, "": 1},
        )
    )
    picks = {policy.place(m.PlacementRequest(request_id="n", model="m", prompt_tokens=100, adapter="new@1")).worker_id
             for _ in range(20)}
    assert "a" not in picks


def test_an_adapter_whose_homes_are_crowded_takes_a_new_home_on_a_quieter_worker() -> None:
    clock = Clock()
    slots = AdapterSlots(clock)
    for _ in range(850):
        slots.observe(None)
    for _ in range(150):  # 15% of the traffic: one home wanted (ceil(0.15 · 3 · 2) = 1)
        slots.observe("warm")
    slots.on_placed("w1", "warm")  # its one home
    pool = workers("w1", "w2", "w3", loaded={"w1": {"warm"}})
    assert slots.costs("warm", pool)[1] == pytest.approx(
        slots.config.away_s + 2 * slots.config.load_s
    )  # balanced: it stays home
    for _ in range(600):  # w1 takes twice its share of the recent placements
        slots.on_placed("w1", None)
    for _ in range(150):
        slots.on_placed("w2", None)
        slots.on_placed("w3", None)
    for w in ("w1", "w2", "w3"):
        slots.on_load(w, {"": 4})  # each holds 4 requests now
    costs = slots.costs("warm", pool)
    # w2 may become a home (no `away_s`), though not before the adapter is loaded there; w1 pays for its excess.
    assert costs[1] == pytest.approx(2 * slots.config.load_s)
    assert costs[0] == pytest.approx(slots.config.balance_s * slots.excess(["w1", "w2", "w3"])["w1"])
    # ~3 requests/s of "warm", half of them moved for 30 s, each 0.75 s cheaper: far more than a
    # 0.5 s read holding up w2's 4 requests and the next one.
    homes = slots.homes["warm"].workers
    excess = slots.excess(["w1", "w2", "w3"])
    assert slots.copy_gain("warm", "w2", homes, excess) == pytest.approx(
        0.15 * 901 * math.log(2) / 30 * 30 / 2 * 0.5 * (excess["w1"] - excess["w2"]))
    assert slots.copy_cost("w2") == pytest.approx(0.5 * 5)
    # A tail adapter's traffic would not pay for the read (it stops w2's or w3's batches): it
    # moves only to a worker that holds it already.
    slots.observe("tail")
    slots.on_placed("w1", "tail")
    assert slots.warm_target("tail", pool) is None
    tail_costs = slots.costs("tail", workers("w1", "w2", "w3", loaded={"w1": {"tail"}, "w3": {"tail"}}))
    assert tail_costs[1] == pytest.approx(slots.config.away_s + 2 * slots.config.load_s) and tail_costs[2] == 0.0
    # On a worker holding 80 requests the read would cost more than the copy gains: "warm" is
    # loaded in the background on the other quiet worker.
    slots.on_load("w2", {"": 80})
    assert slots.costs("warm", pool)[1] == pytest.approx(slots.config.away_s + 2 * slots.config.load_s)
    assert slots.warm_target("warm", pool) == "w3"
    assert slots.warm_target("warm", pool) is None  # once


def test_a_cold_adapter_goes_to_the_worker_whose_load_queue_ends_first() -> None:
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(load_s=0.5))
    pool = workers("w1", "w2", "w3")
    # w1 is loading two adapters (ready in 0.3 and 0.9 s); w2 measured 0.4 s per load, none queued.
    slots.on_load("w1", {}, {"x": 0.3, "y": 0.9}, adapter_load_s=0.3)
    slots.on_load("w2", {}, {}, adapter_load_s=0.4)
    assert slots.load_wait("w1", "x", frozenset()) == pytest.approx(0.3)  # queued there: its time left
    assert slots.load_wait("w1", "new", frozenset()) == pytest.approx(0.9 + 0.3)  # the queue, then its own
    assert slots.load_wait("w2", "new", frozenset()) == pytest.approx(0.4)
    assert slots.load_wait("w3", "new", frozenset()) == pytest.approx(0.5)  # nothing measured: the default
    clock.now += 0.2  # the report ages: w1's queue is 0.2 s shorter now
    assert slots.load_wait("w1", "new", frozenset()) == pytest.approx(0.7 + 0.3)
    costs = slots.costs("new", pool)
    assert costs.index(min(costs)) == 1
    # Placed on w2, which must load it: until a report shows that load, it counts in w2's queue.
    slots.on_placed("w2", "new", frozenset())
    assert slots.load_wait("w2", "new", frozenset()) == pytest.approx(0.4)
    assert slots.load_wait("w2", "other", frozenset()) == pytest.approx(0.8)
    slots.on_load("w2", {"new": 1}, {"new": 0.35}, adapter_load_s=0.4)  # the report counts it now
    assert slots.asked["w2"] == {} and slots.load_wait("w2", "other", frozenset()) == pytest.approx(0.75)
    slots.on_placed("w3", "lost", frozenset())  # a load asked for that no report ever shows
    clock.now += 10.0
    slots.on_load("w3", {}, {})
    assert slots.asked["w3"] == {}
    assert slots.load_wait("w2", "new", frozenset({"new"})) == 0.0  # loaded


def test_a_hot_adapter_is_loaded_on_its_next_home_before_traffic_moves_there() -> None:
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(load_s=0.5))
    for _ in range(30):  # a third of the traffic: 3 homes wanted
        slots.observe("hot")
        slots.observe(None)
        slots.observe(None)
    loaded = {"w1": {"hot"}}
    slots.on_placed("w1", "hot", frozenset(loaded["w1"]))
    pool = workers("w1", "w2", "w3", "w4", loaded=loaded)
    costs = slots.costs("hot", pool)
    assert costs.index(min(costs)) == 0  # not moved to a worker that would load it first
    target = slots.warm_target("hot", pool)
    assert target in ("w2", "w3", "w4")
    assert slots.warm_target("hot", pool) is None  # one warm-up at a time while it loads
    slots.on_load(target, {}, {"other": 0.1, "hot": 0.4})
    assert slots.warm_target("hot", pool) is None  # the report shows it loading
    loaded[target] = {"hot"}
    slots.on_load(target, {}, {}, loaded=frozenset({"hot"}))
    pool = workers("w1", "w2", "w3", "w4", loaded=loaded)
    costs = slots.costs("hot", pool)
    assert costs[["w1", "w2", "w3", "w4"].index(target)] == 0.0  # loaded, homes open: as cheap as a home
    slots.on_placed(target, "hot", frozenset({"hot"}))
    next_target = slots.warm_target("hot", pool)  # still short of 3 homes: the next one warms up
    assert next_target not in (None, "w1", target)


def test_an_evicted_adapter_costs_its_reload_even_on_its_home() -> None:
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(load_s=0.5))
    for _ in range(100):
        slots.observe(None)
    slots.observe("a")  # a tail adapter: one home
    slots.on_placed("w1", "a", frozenset({"a"}))
    slots.on_load("w2", {}, {}, adapter_load_s=0.3)
    # The engine evicted it from w1 (--max-loaded-loras) and w1 has a long load queue.
    slots.on_load("w1", {}, {"b": 1.0, "c": 2.0}, adapter_load_s=0.3)
    costs = slots.costs("a", workers("w1", "w2"))  # each fresh load once more for the batches it stops
    assert costs[0] == pytest.approx(2.3 + 0.3) and costs[1] == pytest.approx(slots.config.away_s + 0.3 + 0.3)


def test_crowding_moves_adapters_with_traffic_and_leaves_the_tail_on_one_worker() -> None:
    """A new home's load stops its engine's batches for the read (and on an engine with
    --max-loaded-loras evicts another adapter once it is full); for a tail adapter that copy serves
    almost nothing, for a hot one it moves real load."""
    clock = Clock()
    slots = AdapterSlots(clock)
    for w in ("w1", "w2", "w3"):
        slots.on_cap(w, 200)
    for _ in range(100):
        slots.observe(None)
    slots.observe("tail")  # ~1% of the traffic
    for _ in range(10):
        slots.observe("hot")  # ~9%
    slots.on_placed("w1", "tail")
    slots.on_placed("w1", "hot")
    for _ in range(60):  # w1 takes twice its share of the recent placements
        slots.on_placed("w1", None)
    for _ in range(15):
        slots.on_placed("w2", None)
        slots.on_placed("w3", None)
    for w in ("w1", "w2", "w3"):
        slots.on_load(w, {})  # every request finished
    pool = workers("w1", "w2", "w3", loaded={"w1": {"tail", "hot"}, "w3": {"tail"}})
    load, away = slots.config.load_s, slots.config.away_s
    # The tail adapter: no new home where it would be loaded, but a worker holding it already may take it.
    assert slots.costs("tail", pool)[1:] == pytest.approx([away + 2 * load, 0.0])
    assert slots.warm_target("tail", workers("w1", "w2", "w3", loaded={"w1": {"tail"}})) is None
    # The hot one opens a home, loaded in the background first.
    assert slots.costs("hot", pool)[1] == pytest.approx(2 * load)
    assert slots.warm_target("hot", pool) in ("w2", "w3")
    # Without a cap a copy evicts nothing, but its load still stops the engine's batches: the tail stays.
    slots.on_cap("w2", 0)
    slots.on_cap("w3", 0)
    assert slots.warm_target("tail", workers("w1", "w2", "w3", loaded={"w1": {"tail"}})) is None


def test_a_load_under_way_holds_up_every_request_on_its_worker() -> None:
    # The engine reads the adapter inside its scheduler's loop: no batch runs meanwhile, so a
    # request for a loaded adapter, or for the base model, goes to a worker that is not loading.
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(load_s=0.5))
    slots.on_load("w1", {}, {"x": 0.3, "y": 0.6}, adapter_load_s=0.3)
    slots.on_load("w2", {}, {}, adapter_load_s=0.3)
    everywhere = {"w1": {"a"}, "w2": {"a"}}
    assert slots.stall("w1", frozenset({"a"})) == pytest.approx(0.3)  # the load under way, not the queue
    away = slots.config.away_s  # a is at home on neither
    assert slots.costs("a", workers("w1", "w2", loaded=everywhere)) == pytest.approx([away + 0.3, away])
    assert slots.costs(None, workers("w1", "w2")) == pytest.approx([0.3, 0.0])
    clock.now += 0.1
    assert slots.stall("w1", frozenset()) == pytest.approx(0.2)
    slots.on_placed("w2", "b", frozenset())  # w2 must load b: asked for, no report shows it yet
    assert slots.stall("w2", frozenset()) == pytest.approx(0.3)
    assert slots.costs("a", workers("w1", "w2", loaded=everywhere)) == pytest.approx([away + 0.2, away + 0.3])


def test_with_slowed_engines_the_adapter_terms_run_on_engine_time() -> None:
    # Engines at --time-scale 10 take 10 wall seconds per engine second: a 0.3 s load measures 3 s
    # on the worker's clock, and the token terms of the cost are engine seconds, so the adapter
    # terms are read in engine seconds too.
    clock = Clock()
    slots = AdapterSlots(clock, AdapterConfig(time_scale=10.0))
    slots.on_load("w1", {}, {"x": 3.0}, adapter_load_s=3.0)
    assert slots.load_wait("w1", "y", frozenset()) == pytest.approx(0.3 + 0.3)
    clock.now += 1.0  # a tenth of an engine second
    assert slots.stall("w1", frozenset()) == pytest.approx(0.2)
    assert slots.clock() == pytest.approx(100.1)
