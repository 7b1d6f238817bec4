"""Prefetching registered LoRA adapters into engines' host memory: only under a cap, one copy in
the fleet, spread by rendezvous hash, one prefetch per worker at a time, never past the cap."""

from __future__ import annotations

from collections import Counter

import pytest

from services.router.adapter_prefetch import Prefetcher, PrefetchWorker


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_nothing_is_prefetched_to_an_engine_without_a_cap() -> None:
    prefetcher = Prefetcher(Clock())
    assert prefetcher.plan(["a", "b"], [PrefetchWorker("w1", cap=0, loaded=frozenset())]) == []


@pytest.mark.slow
def test_prefetches_fill_each_worker_up_to_its_cap_one_at_a_time_and_spread_evenly() -> None:
    clock = Clock()
    prefetcher = Prefetcher(clock)
    registered = [f"ft-{i:04d}" for i in range(400)]
    loaded: dict[str, set[str]] = {w: set() for w in ("w1", "w2", "w3", "w4")}
    loaded["w1"] = {"ft-0000"}  # requested before: not prefetched again

    def fleet() -> list[PrefetchWorker]:
        return [PrefetchWorker(w, cap=60, loaded=frozenset(names)) for w, names in loaded.items()]

    first = prefetcher.plan(registered, fleet())
    assert sorted(w for w, _ in first) == ["w1", "w2", "w3", "w4"]  # one per worker at a time
    assert prefetcher.plan(registered, fleet()) == []  # each still loading its one
    for _ in range(400):
        for worker, adapter in prefetcher.plan(registered, fleet()):
            loaded[worker].add(adapter)  # the worker loaded it and reports it
        clock.now += 1.0
    assert all(len(names) == 60 for names in loaded.values())  # filled to the cap, never past it
    everywhere = Counter(a for names in loaded.values() for a in names)
    assert max(everywhere.values()) == 1  # one copy in the fleet


def test_recently_requested_adapters_come_first_and_a_lost_prefetch_is_asked_again() -> None:
    clock = Clock()
    prefetcher = Prefetcher(clock, ttl_s=10.0)
    workers = [PrefetchWorker("w1", cap=10, loaded=frozenset())]
    assert prefetcher.plan(["cold", "evicted"], workers, share=lambda a: 0.2 if a == "evicted" else 0.0) == \
        [("w1", "evicted")]
    assert prefetcher.plan(["cold", "evicted"], workers) == []  # under way
    clock.now += 11.0  # never showed up as loaded: asked for again
    assert prefetcher.plan(["cold", "evicted"], workers, share=lambda a: 0.2 if a == "evicted" else 0.0) == \
        [("w1", "evicted")]


def test_a_worker_busy_with_loads_and_its_reported_prefetches_gets_no_more() -> None:
    prefetcher = Prefetcher(Clock())
    busy = PrefetchWorker("w1", cap=10, loaded=frozenset(), prefetches=1)  # e.g. asked by another router
    assert prefetcher.plan(["a", "b"], [busy]) == []
    full = PrefetchWorker("w1", cap=3, loaded=frozenset({"x", "y"}), loading=("z",))
    assert prefetcher.plan(["a", "b"], [full]) == []  # loaded and loading fill the cap
    two = [PrefetchWorker("w1", cap=3, loaded=frozenset({"x", "y"}), loading=("z",)),
           PrefetchWorker("w2", cap=3, loaded=frozenset())]
    assert prefetcher.plan(["a", "z"], two) == [("w2", "a")]  # z is being loaded on w1 already
