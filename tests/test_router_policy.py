import random

import msgspec
import pytest

from proto import messages as m
from services.router.config import RoutingConfig
from services.router.index import PrefixIndex
from services.router.placement import Placer, make_placer
from services.router.policies import POLICY_NAMES, make_policy
from services.router.registry import share_cost


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, state: str = "ready") -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=0, ts=0, state=state, max_running=10)  # type: ignore[arg-type]


def load(worker_id: str, running: int, kv: float = 0.0, pulled_own: int = 0) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker_id, model="m", ts=0, seq=1, running=running, waiting=0, in_flight=running,
                        max_running=10, kv_used_tokens=int(kv * 1000), kv_capacity_tokens=1000, pulled_own=pulled_own)


def ask() -> m.PlacementRequest:
    return m.PlacementRequest(request_id="r", model="m", prompt_tokens=10)


def test_least_loaded_worker_wins_and_own_placements_count_before_the_next_report() -> None:
    clock = Clock()
    router = make_placer("least_loaded", clock, RoutingConfig(temperature=0.001), random.Random(1))
    for w in ("a", "b"):
        router.registry.on_heartbeat(beat(w))
    router.registry.on_load(load("a", 5))
    router.registry.on_load(load("b", 2))
    picks = [router.place(ask()).worker_id for _ in range(6)]
    assert picks[:3] == ["b", "b", "b"]  # b fills up to a's level from its own placements
    assert set(picks[3:]) == {"a", "b"}


def test_draining_full_dead_and_other_model_workers_are_filtered() -> None:
    clock = Clock()
    router = make_placer("affinity", clock, RoutingConfig(heartbeat_ttl_s=3))
    router.registry.on_heartbeat(beat("draining", state="draining"))
    router.registry.on_heartbeat(beat("full"))
    router.registry.on_load(load("full", 0, kv=0.99))
    router.registry.on_heartbeat(
        m.Heartbeat(worker_id="other", model="x", engine_url="", started=0, ts=0, max_running=1)
    )
    assert router.place(ask()).worker_id == "full"  # every KV past the ceiling: the cost decides
    router.registry.on_heartbeat(beat("ok"))
    assert router.place(ask()).worker_id == "ok"
    clock.now += 4
    assert router.place(ask()).target == "any"
    assert set(router.registry.expire()) == {"draining", "full", "other", "ok"}


def cache(
    worker_id: str, seq: int, stored: list[int] = (), removed: list[int] = (), cleared: bool = False
) -> m.CacheEvent:
    return m.CacheEvent(
        worker_id=worker_id,
        seq=seq,
        ts=0,
        stored=[m.BlockStored(block_hashes=list(stored))] if stored else [],
        removed=list(removed),
        cleared=cleared,
    )


def prompt(hashes: list[int], tokens: int | None = None, adapter: str | None = None) -> m.PlacementRequest:
    return m.PlacementRequest(
        request_id="r",
        model="m",
        prompt_tokens=tokens or 64 * len(hashes) + 10,
        block_hashes=hashes,
        block_size=64,
        adapter=adapter,
    )


def affinity(clock: Clock, **config: float) -> Placer:
    router = make_placer("affinity", clock, RoutingConfig(temperature=0.001, **config), random.Random(7))
    for w in ("a", "b", "c"):
        router.registry.on_heartbeat(beat(w))
        router.registry.on_load(load(w, 0))
    return router


def test_prefix_index_counts_leading_blocks_only_and_stays_bounded() -> None:
    index = PrefixIndex(max_blocks_per_worker=3, ttl_s=10)
    index.add("a", [1, 2, 3], now=0)
    index.add("b", [1, 9], now=0)
    assert index.matched_blocks([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.matched_blocks([2, 3]) == {"a": 2}  # chained hashes: any block names its whole prefix
    index.add("a", [5], now=5)  # over the cap: the least recently used block goes, a leaf (3) before its root
    assert index.matched_blocks([1, 2, 3]) == {"a": 2, "b": 1}
    index.remove("a", [2])
    assert index.blocks_of("a") == 2
    assert index.expire(now=12) == 3 and index.blocks_of("a") == 1  # a:3 and b's two blocks were older than 10 s
    index.forget("a")
    assert len(index) == 0


def test_bisection_finds_every_workers_depth_on_long_prompts() -> None:
    index = PrefixIndex()
    chain = list(range(1000, 1250))
    for worker, depth in (("a", 250), ("b", 7), ("c", 1), ("d", 128), ("e", 129)):
        index.add(worker, chain[:depth], now=0)
    index.add("f", [999], now=0)
    assert index.matched_blocks(chain) == {"a": 250, "b": 7, "c": 1, "d": 128, "e": 129}
    assert index.matched_blocks(chain[:1]) == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}
    assert index.matched_blocks([5, 6]) == {}


def test_affinity_sends_a_shared_prefix_to_the_worker_that_holds_it() -> None:
    clock = Clock()
    router = affinity(clock)
    assert router.registry.on_cache(cache("b", 1, stored=list(range(100)), cleared=True))
    reply = router.place(prompt(list(range(100)) + [500, 501]))
    assert reply.worker_id == "b" and reply.cached_blocks == 100 and reply.reason == "affinity"
    # Its own placement is remembered: the next turn of the conversation follows without an event.
    assert router.place(prompt(list(range(100)) + [500, 501, 502])).worker_id == "b"


def test_a_hot_prefix_spills_to_the_next_worker_once_its_queue_costs_more_than_recomputing() -> None:
    clock = Clock()
    router = affinity(clock, prefill_tokens_per_s=10_000)
    router.registry.on_cache(cache("a", 1, stored=list(range(10)), cleared=True))
    picks = [router.place(prompt(list(range(10)) + [1000 + i], tokens=2000)).worker_id for i in range(12)]
    assert picks[0] == "a"
    assert {"b", "c"} <= set(picks)  # spilled once a's queued prefill outweighed the 640 cached tokens
    # ...and the spill target now holds the prefix too (it will after serving it).
    spill = next(w for w in picks if w != "a")
    assert router.registry.index.matched_blocks(list(range(10)))[spill] == 10


def test_queued_prefill_and_decode_load_steer_requests_without_a_shared_prefix() -> None:
    clock = Clock()
    router = affinity(clock)
    for worker_id, running, queued in (("a", 9, 50_000), ("b", 1, 0), ("c", 10, 0)):
        router.registry.on_load(msgspec.structs.replace(load(worker_id, running), seq=2, queued_prefill_tokens=queued))
    assert router.place(prompt([1, 2, 3])).worker_id == "b"


def test_cache_event_gaps_and_mid_stream_joins_ask_for_a_resync() -> None:
    clock = Clock()
    router = affinity(clock)
    assert not router.registry.on_cache(cache("a", 41, stored=[1]))  # first heard mid-stream: ask for a snapshot
    assert router.registry.on_cache(cache("a", 42, stored=[1, 2], cleared=True))
    assert router.registry.on_cache(cache("a", 43, removed=[2]))
    assert not router.registry.on_cache(cache("a", 45, stored=[3]))  # 44 was lost
    assert router.registry.index.matched_blocks([1, 2]) == {"a": 1}
    assert router.registry.on_cache(cache("unknown", 1, stored=[1]))  # not registered yet: ignored, no resync storm


def test_cache_events_in_other_blocks_than_the_routers_are_ignored() -> None:
    # An engine paging its cache in 16-token blocks reports hashes that 64-token prompt hashes
    # never match: indexing them would only crowd out the index.
    clock = Clock()
    router = affinity(clock)  # block_size 64
    router.registry.on_heartbeat(
        m.Heartbeat(worker_id="small", model="m", engine_url="", started=0, ts=0, max_running=10, block_size=16)
    )
    router.registry.on_heartbeat(
        m.Heartbeat(worker_id="same", model="m", engine_url="", started=0, ts=0, max_running=10, block_size=64)
    )
    assert not router.registry.cache_compatible(router.registry.workers["small"]) and router.registry.cache_compatible(
        router.registry.workers["same"]
    )
    assert router.registry.on_cache(cache("small", 1, stored=[1, 2], cleared=True))
    assert router.registry.on_cache(cache("same", 1, stored=[1, 2], cleared=True))
    assert router.registry.index.matched_blocks([1, 2]) == {"same": 2}


def test_adapters_prefer_workers_that_have_them_and_skip_engines_without_lora() -> None:
    clock = Clock()
    router = affinity(clock)
    router.registry.on_heartbeat(
        m.Heartbeat(worker_id="a", model="m", engine_url="", started=0, ts=0, max_running=10, max_adapters=0)
    )
    router.registry.on_heartbeat(
        m.Heartbeat(
            worker_id="b",
            model="m",
            engine_url="",
            started=0,
            ts=0,
            max_running=10,
            max_adapters=4,
            adapters=["support@v1"],
        )
    )
    router.registry.on_heartbeat(
        m.Heartbeat(worker_id="c", model="m", engine_url="", started=0, ts=0, max_running=10, max_adapters=4)
    )
    for _ in range(100):  # a tail adapter (an adapter with all the traffic spreads: test_adapter_slots.py)
        router.registry.adapter_slots.observe(None)
    picks = {router.place(prompt([7], adapter="support@v1")).worker_id for _ in range(5)}
    assert picks == {"b"}
    assert router.place(prompt([7], adapter="other@v2")).worker_id in {"b", "c"}


def test_router_replicas_count_each_others_placements() -> None:
    clock = Clock()
    one, two = affinity(clock), affinity(clock)
    reply = one.place(prompt(list(range(20))))
    two.registry.on_placed(m.Placed(router_id="one", worker_id=reply.worker_id, model="m", prefill_tokens=20 * 64 + 10,
                                    block_hashes=list(range(20))))
    assert two.registry.workers[reply.worker_id].backlog_prefill(1) == 20 * 64 + 10
    assert two.registry.workers[reply.worker_id].intake == 20 * 64 + 10  # an older router's Placed: its prefill
    two.registry.on_placed(m.Placed(router_id="one", worker_id=reply.worker_id, model="m", prefill_tokens=10,
                                    block_hashes=list(range(20)), prompt_tokens=20 * 64 + 10))
    assert two.registry.workers[reply.worker_id].intake == 2 * (20 * 64 + 10)  # the whole prompt, cached part too
    two.registry.on_load(load(reply.worker_id, 1, pulled_own=1))  # the first turn was pulled and prefilled
    assert two.place(prompt(list(range(20)) + [99])).worker_id == reply.worker_id


def test_round_robin_takes_turns_and_unknown_policies_are_refused() -> None:
    clock = Clock()
    router = make_placer("round_robin", clock)
    for w in ("a", "b", "c"):
        router.registry.on_heartbeat(beat(w))
    assert sorted(router.place(ask()).worker_id for _ in range(3)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="affinity"):
        make_placer("random", clock)


def test_a_dead_worker_is_forgotten_with_its_cache_entries() -> None:
    clock = Clock()
    router = affinity(clock)
    router.registry.on_cache(cache("a", 1, stored=[1, 2, 3], cleared=True))
    clock.now += 2
    for w in ("b", "c"):
        router.registry.on_heartbeat(beat(w))
    clock.now += 2
    assert router.registry.expire() == ["a"]
    assert router.registry.index.blocks_of("a") == 0 and "a" not in router.registry.workers


def test_requests_still_waiting_in_a_workers_own_queue_count_after_its_report() -> None:
    clock = Clock()
    router = affinity(clock, miss_weight=1.5)
    router.registry.on_cache(cache("a", 1, stored=list(range(40)), cleared=True))
    for _ in range(6):
        assert router.place(prompt(list(range(40)))).worker_id == "a"
    # `a` reports two pulled and running: the other four still wait in its queue and keep counting.
    router.registry.on_load(msgspec.structs.replace(load("a", 2, pulled_own=2), seq=3))
    view = router.registry.workers["a"]
    assert view.backlog() == 4 and view.reported_load + view.backlog() == 6
    picks = [router.place(prompt(list(range(40)))).worker_id for _ in range(10)]
    assert {"b", "c"} & set(picks)  # the hot prefix spills once a's slots and queue outweigh the cache


def test_any_policy_object_places_from_the_shared_registry_and_filters() -> None:
    class Last:
        """A policy in a few lines: the protocol is all the placer needs."""

        name = "last"
        rng = random.Random(0)

        def choose(self, request, candidates):
            return max(candidates, key=lambda view: view.worker_id), 0

        def load_cost(self, view, backlog):
            return None

        def load_only(self, request):
            return True

    clock = Clock()
    registry = make_placer("round_robin", clock).registry
    router = Placer(registry, Last())
    for w in ("a", "b", "z"):
        registry.on_heartbeat(beat(w))
    registry.on_load(load("z", 0, kv=0.99))  # past the KV ceiling: the registry's filter drops it
    reply = router.place(ask())
    assert (reply.worker_id, reply.reason) == ("b", "last")
    assert registry.workers["b"].backlog() == 1  # counted by the registry
    assert {name: type(make_policy(name, registry)).__name__ for name in POLICY_NAMES} == {
        "affinity": "AffinityPolicy", "least_loaded": "LeastLoadedPolicy", "round_robin": "RoundRobinPolicy"}


def test_share_cost_is_a_barrier_at_the_limit_and_a_small_bonus_below_the_mean() -> None:
    config = RoutingConfig(share_weight_s=1.0, share_limit=0.15)
    assert share_cost(0.0, config) == 0.0
    assert share_cost(0.075, config) == pytest.approx(1.0)  # the weight at half the limit
    assert share_cost(0.14, config) == pytest.approx(14.0)
    assert 50 < share_cost(0.15, config) < share_cost(0.3, config)  # prohibitive at the limit, ranked past it
    assert share_cost(-0.075, config) == pytest.approx(-0.5)
    assert share_cost(-3.0, config) == pytest.approx(-1.0)


def test_a_worker_past_its_share_of_recent_traffic_loses_even_a_cached_family() -> None:
    def hits(router: Placer) -> list[str]:
        picks = []
        for i in range(4):
            picks.append(router.place(prompt(list(range(100)) + [1000 + i])).worker_id or "")
            router.registry.expire()  # the registry's tick takes the fleet's mean intake
        return picks

    clock = Clock()
    cases = (
        (affinity(clock, share_weight_s=0.0), False),
        # Four requests are too few to judge shares by (the limit is 15 requests' worth wide)...
        (affinity(clock), False),
        # ...but where they would be enough, "a" holding all of the fleet's traffic is far past it.
        (affinity(clock, share_granularity=0.1), True),
    )
    for router, spreads in cases:
        router.registry.on_cache(cache("a", 1, stored=list(range(100)), cleared=True))
        picks = hits(router)
        assert picks[0] == "a"
        # Each hit queues only 10 tokens of prefill there.
        assert (len(set(picks)) > 1) is spreads
    # Cached tokens count in the share, not only the 10 prefilled: a took two of the four hits.
    assert router.registry.workers["a"].intake == 2 * (101 * 64 + 10)
