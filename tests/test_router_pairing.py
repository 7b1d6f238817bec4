"""Placement on a disaggregated fleet (services/router/pairing.py): which prefill and which decode
worker a request gets, and when a decode worker prefills itself."""

from __future__ import annotations

import random

from inferbus.tokens.blocks import block_hashes
from proto import messages as m
from services.router.config import RoutingConfig
from services.router.pairing import PairConfig, PairPolicy
from services.router.placement import Placer, make_placer

BLOCK = 64


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, role: str, zone: str = "", adapters: int = 0, local_prefill: bool = False,
         kv_capacity: int = 100_000) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=0, ts=0, max_running=10, role=role,
                       zone=zone, max_adapters=adapters, local_prefill=local_prefill, kv_capacity_tokens=kv_capacity,
                       block_size=BLOCK)


def load(worker_id: str, running: int = 0, waiting: int = 0, kv_used: int = 0, kv_capacity: int = 100_000,
         queued_prefill: int = 0, role: str = "decode") -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker_id, model="m", ts=0, seq=1, running=running, waiting=waiting,
                        in_flight=running + waiting, max_running=10, kv_used_tokens=kv_used,
                        kv_capacity_tokens=kv_capacity, queued_prefill_tokens=queued_prefill, role=role)


def placer(**config: object) -> Placer:
    return make_placer(
        "affinity",
        Clock(),
        RoutingConfig(temperature=1e-6, share_weight_s=0, block_size=BLOCK, **config),  # type: ignore[arg-type]
        random.Random(7),
    )


def ask(
    ids: list[int], zone: str = "", adapter: str | None = None, role: str = "", avoid: list[str] | None = None
) -> m.PlacementRequest:
    return m.PlacementRequest(
        request_id="r",
        model="m",
        prompt_tokens=len(ids),
        adapter=adapter,
        zone=zone,
        role=role,
        block_hashes=block_hashes(ids, BLOCK, namespace=adapter or ""),
        block_size=BLOCK,
        avoid=avoid or [],
    )


def cache(router: Placer, worker_id: str, ids: list[int]) -> None:
    router.registry.on_cache(m.CacheEvent(worker_id=worker_id, seq=0, ts=0, stored=[
        m.BlockStored(block_hashes=block_hashes(ids, BLOCK), block_size=BLOCK)]))


PROMPT = list(range(2_000))


def test_prefill_by_prefix_cache_and_decode_by_load_not_the_other_way() -> None:
    router = placer()
    for w, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")):
        router.registry.on_heartbeat(beat(w, role))
    cache(router, "p2", PROMPT)  # the prefill side's cache is the one that counts
    cache(router, "d1", PROMPT)  # a decode engine's cache saves only the transfer (ms), not its load
    router.registry.on_load(load("d1", running=8))
    router.registry.on_load(load("d2", running=1))
    reply = router.place(ask(PROMPT))
    assert (reply.worker_id, reply.prefill_worker_id) == ("d2", "p2")
    assert reply.target == "w.d2" and reply.reason == "pair"
    assert reply.prefill_cached_blocks == len(PROMPT) // BLOCK and reply.cached_blocks == 0


def test_decode_with_kv_room_wins_over_an_idle_one_without() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("p", "prefill"))
    for w in ("roomy", "full"):
        router.registry.on_heartbeat(beat(w, "decode", kv_capacity=10_000))
    router.registry.on_load(load("full", running=0, kv_used=9_000, kv_capacity=10_000))
    router.registry.on_load(load("roomy", running=6, kv_used=1_000, kv_capacity=10_000))
    assert router.place(ask(PROMPT)).worker_id == "roomy"  # 2,000 prompt tokens do not fit in "full"


def test_the_pair_stays_in_one_zone_and_the_gateways_zone_first() -> None:
    router = placer()
    for w, role, zone in (("pa", "prefill", "a"), ("pb", "prefill", "b"), ("da", "decode", "a"), ("db", "decode", "b")):
        router.registry.on_heartbeat(beat(w, role, zone))
    cache(router, "pa", PROMPT)  # cheapest prefill is in zone a; the request comes from zone b
    reply = router.place(ask(PROMPT, zone="b"))
    assert (reply.worker_id, reply.prefill_worker_id) == ("db", "pb")
    reply = router.place(ask(PROMPT, zone="a"))
    assert (reply.worker_id, reply.prefill_worker_id) == ("da", "pa")


def test_a_pair_never_crosses_zones_while_the_decode_workers_zone_has_a_prefill_worker() -> None:
    router = placer()
    for w, role, zone in (("pa", "prefill", "a"), ("pb", "prefill", "b"), ("db", "decode", "b")):
        router.registry.on_heartbeat(beat(w, role, zone))
    cache(router, "pa", PROMPT)  # the cheapest prefill worker is in zone a, the only decode worker in zone b
    for zone in ("", "c"):  # no gateway zone, or one without workers: every candidate is offered
        reply = router.place(ask(PROMPT, zone=zone))
        assert (reply.worker_id, reply.prefill_worker_id) == ("db", "pb")


def test_a_decode_worker_without_kv_room_for_the_prompt_is_left_out() -> None:
    router = placer()
    registry = router.registry
    registry.on_heartbeat(beat("p", "prefill"))
    for w in ("roomy", "full"):
        registry.on_heartbeat(beat(w, "decode", kv_capacity=10_000))
    registry.on_load(load("full", running=0, kv_used=9_000, kv_capacity=10_000))
    registry.on_load(load("roomy", running=10, kv_used=1_000, kv_capacity=10_000))
    pairing = PairPolicy(
        registry, PairConfig(decode_kv_weight_s=0.0), random.Random(1)
    )  # the load alone prefers "full"
    request = ask(PROMPT)
    for _ in range(5):
        pair = pairing.choose(request, registry.candidates(request))
        assert pair is not None and pair.decode.worker_id == "roomy"


def test_both_halves_serve_the_adapter() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("p-nolora", "prefill"))
    router.registry.on_heartbeat(beat("p-lora", "prefill", adapters=4))
    router.registry.on_heartbeat(beat("d-nolora", "decode"))
    router.registry.on_heartbeat(beat("d-lora", "decode", adapters=4))
    for _ in range(5):
        reply = router.place(ask(PROMPT, adapter="a@123"))
        assert (reply.worker_id, reply.prefill_worker_id) == ("d-lora", "p-lora")


def test_placements_count_on_both_halves_before_any_report() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("p1", "prefill"))
    router.registry.on_heartbeat(beat("p2", "prefill"))
    router.registry.on_heartbeat(beat("d1", "decode"))
    router.registry.on_heartbeat(beat("d2", "decode"))
    pairs = [router.place(ask([i] * 3_000)) for i in range(4)]
    # Uncached prompts (four unrelated ones) queue on the prefill worker chosen, load on the decode worker: both
    # alternate.
    assert {r.prefill_worker_id for r in pairs} == {"p1", "p2"}
    assert {r.worker_id for r in pairs} == {"d1", "d2"}
    views = router.registry.workers
    assert views["d1"].backlog() + views["d2"].backlog() == 4
    assert (
        views["p1"].backlog_prefill(views["p1"].backlog()) + views["p2"].backlog_prefill(views["p2"].backlog())
        == 4 * 3_000
    )
    assert views["d1"].backlog_prefill(views["d1"].backlog()) == 0  # a decode worker computes no prompt


def test_a_decode_worker_asking_for_a_prefill_gets_one_of_its_zone_not_one_it_avoids() -> None:
    router = placer()
    for w, role, zone in (
        ("pa", "prefill", "a"),
        ("pa2", "prefill", "a"),
        ("pb", "prefill", "b"),
        ("da", "decode", "a"),
    ):
        router.registry.on_heartbeat(beat(w, role, zone))
    cache(router, "pa", PROMPT)
    reply = router.place(ask(PROMPT, zone="a", role="prefill"))
    assert (reply.worker_id, reply.reason, reply.cached_blocks) == ("pa", "prefill", len(PROMPT) // BLOCK)
    assert router.place(ask(PROMPT, zone="a", role="prefill", avoid=["pa"])).worker_id == "pa2"
    assert router.place(ask(PROMPT, zone="a", role="prefill", avoid=["pa", "pa2"])).worker_id == "pb"
    assert router.place(ask(PROMPT, zone="a", role="prefill", avoid=["pa", "pa2", "pb"])).target == "any"


def test_decode_workers_without_a_prefill_worker_are_no_option() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("d", "decode"))
    assert router.place(ask(PROMPT)).target == "any"
    router.registry.on_heartbeat(beat("agg", "aggregated"))
    assert router.place(ask(PROMPT)).worker_id == "agg"  # a mixed fleet: the aggregated worker serves


def test_conditional_disaggregation_short_remainders_stay_on_a_decode_worker_that_can_prefill() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("p", "prefill"))
    router.registry.on_heartbeat(beat("d", "decode", local_prefill=True))
    router.registry.on_load(load("p", queued_prefill=20_000, role="prefill"))  # 2 s of queued prefill
    short = router.place(ask(list(range(300))))
    assert (short.worker_id, short.prefill_worker_id, short.reason) == ("d", None, "local_prefill")
    long = router.place(ask(list(range(1_500))))  # past local_prefill_max_tokens: always the prefill worker
    assert (long.worker_id, long.prefill_worker_id) == ("d", "p")


def test_local_prefill_is_priced_against_the_stall_it_puts_on_running_streams() -> None:
    policy_router = placer()
    registry = policy_router.registry
    registry.on_heartbeat(beat("p", "prefill"))
    registry.on_heartbeat(beat("d", "decode", local_prefill=True))
    pairing = PairPolicy(registry, PairConfig(), random.Random(1))
    request = ask(list(range(800)))
    idle = pairing.choose(request, registry.candidates(request))
    assert idle is not None
    assert idle.local and idle.local_s is not None and idle.remote_s is not None and idle.local_s < idle.remote_s
    registry.on_load(load("d", running=10))  # every stream it runs would wait for the prompt
    busy = pairing.choose(request, registry.candidates(request))
    assert busy is not None and busy.prefill is not None and not busy.local
    assert busy.local_s is not None and busy.remote_s is not None and busy.local_s > busy.remote_s


def test_sglang_decode_engines_never_prefill_locally() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("p", "prefill"))
    router.registry.on_heartbeat(beat("d", "decode"))  # local_prefill false: SGLang's decode mode
    router.registry.on_load(load("p", queued_prefill=200_000, role="prefill"))
    reply = router.place(ask(list(range(100))))
    assert (reply.worker_id, reply.prefill_worker_id) == ("d", "p")


def test_aggregated_fleets_place_as_before() -> None:
    router = placer()
    for w in ("a", "b"):
        router.registry.on_heartbeat(beat(w, "aggregated"))
    cache(router, "b", PROMPT)
    reply = router.place(ask(PROMPT))
    assert (reply.worker_id, reply.prefill_worker_id, reply.reason) == ("b", None, "affinity")
    assert reply.cached_blocks == len(PROMPT) // BLOCK


def test_a_model_whose_prefill_and_decode_workers_are_gone_places_as_aggregated_again() -> None:
    router = placer()
    router.registry.on_heartbeat(beat("agg", "aggregated"))
    router.registry.on_heartbeat(beat("p", "prefill"))
    router.registry.on_heartbeat(beat("d", "decode"))
    assert router.place(ask(PROMPT)).reason in ("pair", "aggregated")  # priced together
    router.registry.on_worker_gone("p")
    router.registry.on_worker_gone("d")
    reply = router.place(ask(PROMPT))
    assert (reply.worker_id, reply.reason) == ("agg", "affinity")  # the aggregated policy, as before


def test_the_kv_transfer_is_priced_on_the_prefill_workers_link() -> None:
    from inferbus.timing import kv_link

    router = placer()
    registry = router.registry
    registry.on_heartbeat(beat("p", "prefill"))
    registry.on_heartbeat(beat("d", "decode", local_prefill=True))
    registry.on_load(load("d", running=10))  # a busy decode worker: on a fast link the prefill worker wins
    request = ask(list(range(800)))
    fast = PairPolicy(registry, PairConfig(link=kv_link("nvlink")), random.Random(1))
    slow = PairPolicy(registry, PairConfig(link=kv_link("rdma", 0.05)), random.Random(1))  # 50 MB/s
    view, decode = registry.workers["p"], registry.workers["d"]
    assert fast.transfer_s(request, view, decode) < 0.001 < 1.0 < slow.transfer_s(request, view, decode)
    pair = fast.choose(request, registry.candidates(request))
    assert pair is not None and pair.prefill is not None
    pair = slow.choose(request, registry.candidates(request))  # moving the KV costs more than the stall
    assert pair is not None and pair.local


def test_a_decode_engine_with_its_own_prefix_cache_is_sent_less_kv() -> None:
    from inferbus.timing import kv_link

    router = placer()
    registry = router.registry
    registry.on_heartbeat(beat("p", "prefill"))
    for w in ("d-cached", "d-cold"):
        registry.on_heartbeat(beat(w, "decode"))
    cache(router, "d-cached", PROMPT)  # a decode engine started with a radix cache publishes its blocks
    slow = PairPolicy(registry, PairConfig(link=kv_link("rdma", 1.0)), random.Random(1))  # 1 GB/s: KV is dear
    request = ask(PROMPT)
    view, decode = registry.workers["p"], registry.workers["d-cached"]
    assert (
        slow.transfer_s(request, view, decode, decode_cached=len(PROMPT))
        < 0.01
        < slow.transfer_s(request, view, decode)
    )
    for _ in range(5):
        pair = slow.choose(request, registry.candidates(request))
        assert pair is not None and pair.decode.worker_id == "d-cached"


def test_the_canaries_gates_read_no_prefill_workers_latencies() -> None:
    """A prefill worker's TTFT is its pool's (accept to KV sent), not the client's: the canary's
    SLO gate, which compares releases on client latencies, leaves it out."""
    from inferbus.releases.slo_gate import SloConfig
    from services.router.canary import CanaryService

    service = CanaryService(None, "router", SloConfig())  # type: ignore[arg-type]
    hist = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
    hist[-1] = 50
    for role in ("prefill", "decode"):
        service.on_load(m.WorkerLoad(worker_id=f"w-{role}", model="m", ts=0, seq=1, running=0, waiting=0, in_flight=0,
                                     max_running=1, kv_used_tokens=0, kv_capacity_tokens=1, release="r1", role=role,
                                     ttft_hist=hist))
        assert ("m" in service.windows) == (role == "decode")
