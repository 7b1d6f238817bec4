"""Prefill/decode disaggregation, the pure parts: the rooms of each role, SGLang's timeouts and
messages, the KV link, and the engine's held and transferred requests (services/sim_engine/disagg.py)."""

from __future__ import annotations

import pytest

from inferbus.timing import KV_LINKS, LLAMA_70B, kv_link
from services.sim_engine.config import EngineConfig
from services.sim_engine.disagg import (
    ABORTED,
    FAKE,
    HANDSHAKE_ATTEMPTS,
    DecodeRooms,
    Held,
    KVPoll,
    LinkQueue,
    PrefillRooms,
    Timeouts,
    decode_failure,
    preallocation_fits,
    prefill_failure,
)
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine

KV_BYTES = 163_840  # FP8 Llama-3-70B: 2 × 80 layers × 8 KV heads × 128 × 1 B


def prefill_rooms(bootstrap_s: float = 300.0, link: str = "rdma", tp: int = 2) -> PrefillRooms:
    return PrefillRooms(Timeouts(bootstrap_s=bootstrap_s), LinkQueue(KV_LINKS[link], tp, LLAMA_70B))


# ---------------------------------------------------------------------------------- the link


def test_transfer_time_is_bytes_over_the_links_of_the_fewer_gpus():
    # 4,000 tokens × 163,840 B over 2 GPUs' 400 Gb/s ports (50 GB/s each, one way): 6.6 ms.
    assert LLAMA_70B.kv_bytes_per_token == KV_BYTES
    assert KV_LINKS["rdma"].transfer_s(4000, 2, 2) == pytest.approx(4000 * KV_BYTES / (2 * 50e9))
    assert KV_LINKS["rdma"].transfer_s(4000, 4, 2) == KV_LINKS["rdma"].transfer_s(4000, 2, 4)  # the fewer GPUs pace it
    assert KV_LINKS["rdma"].transfer_s(4000, 4, 2) == KV_LINKS["rdma"].transfer_s(4000, 2, 2)
    assert KV_LINKS["nvlink"].transfer_s(4000, 2, 2) == pytest.approx(4000 * KV_BYTES / (2 * 450e9))
    assert KV_LINKS["rdma"].transfer_s(0, 2, 2) == 0.0
    assert kv_link("rdma", 100).transfer_s(4000, 2, 2) == pytest.approx(4000 * KV_BYTES / (2 * 100e9))
    with pytest.raises(ValueError):
        kv_link("carrier-pigeon")


def test_sends_queue_on_the_link_one_after_another():
    link = LinkQueue(KV_LINKS["rdma"], 1, LLAMA_70B)
    one = KV_LINKS["rdma"].transfer_s(1000, 1, 1)
    assert link.send(1000, 0.0, 1) == pytest.approx(one)
    assert link.send(1000, 0.0, 1) == pytest.approx(2 * one)  # ready at once, but the link is busy
    assert link.send(1000, 10.0, 1) == pytest.approx(10.0 + one)  # an idle link starts when the KV is ready


# ---------------------------------------------------------------------------------- prefill side


def test_prefill_waits_for_the_decode_sides_destination():
    rooms = prefill_rooms()
    state = rooms.open(7, "r", now=0.0)
    assert state.status == KVPoll.BOOTSTRAPPING
    assert rooms.destination(7, "tcp://d:1", 0, now=1.0) is state
    assert state.status == KVPoll.WAITING_FOR_INPUT and state.destination.endpoint == "tcp://d:1"


def test_a_destination_that_arrives_before_its_request_is_kept():
    rooms = prefill_rooms()
    assert rooms.destination(7, "tcp://d:1", 0, now=0.0) is None
    assert rooms.open(7, "r", now=0.5).status == KVPoll.WAITING_FOR_INPUT


def test_prefill_bootstrap_timeout_fails_only_rooms_still_bootstrapping():
    rooms = prefill_rooms(bootstrap_s=10)
    waiting, bootstrapped = rooms.open(1, "a", 0.0), rooms.open(2, "b", 0.0)
    rooms.destination(2, "tcp://d:1", 0, 1.0)
    assert rooms.expired(9.9) == []
    assert rooms.expired(10.25) == [waiting]
    assert waiting.failure == "Request 1 timed out after 10.2s in KVPoll.Bootstrapping"
    assert bootstrapped.status == KVPoll.WAITING_FOR_INPUT


def test_prefill_sends_each_computed_chunk_and_lands_after_the_last():
    rooms = prefill_rooms(tp=1)
    rooms.open(1, "a", 0.0)
    rooms.destination(1, "tcp://d:1", 0, 0.0)
    rooms.computed(1, 512, now=0.1)
    rooms.computed(1, 512, now=0.2)  # nothing new: nothing sent
    landed = rooms.finish(1, 1000, now=0.3)
    link = KV_LINKS["rdma"]
    assert landed == pytest.approx(0.3 + link.transfer_s(488, 1, 1))  # the first chunk was on its way long before
    state = rooms.succeed(1)
    assert state.status == KVPoll.SUCCESS and state.sent_bytes == 1000 * KV_BYTES
    assert rooms.last_transfer == (pytest.approx(landed - 0.1), 1000 * KV_BYTES)


def test_prefill_sends_nothing_the_decode_engine_already_holds():
    rooms = prefill_rooms()
    rooms.open(1, "a", 0.0)
    rooms.destination(1, "tcp://d:1", 640, 0.0)
    rooms.computed(1, 640, now=0.1)  # the cached prefix the decode side has too
    assert rooms.rooms[1].sent_bytes == 0
    rooms.finish(1, 1000, now=0.2)
    assert rooms.rooms[1].sent_bytes == 360 * KV_BYTES


def test_aborts_on_the_prefill_side_and_from_the_decode_side():
    rooms = prefill_rooms()
    rooms.open(1, "a", 0.0)
    mine = rooms.fail(1, ABORTED)
    assert mine.status == KVPoll.FAILED and rooms.fail(1, ABORTED) is None  # failed once
    rooms.open(2, "b", 0.0)
    theirs = rooms.fail(2, None)  # SGLang records no reason for the decode side's ABORT
    assert prefill_failure("bootstrap", "b", 2, theirs.failure) == (
        "Prefill bootstrap failed for request rank=0 req.rid='b' req.bootstrap_room=2 with exception "
        "KVTransferError(bootstrap_room=2): Failed due to an unknown reason from another rank")


def test_a_room_in_use_cannot_be_opened_twice():
    rooms = prefill_rooms()
    rooms.open(1, "a", 0.0)
    assert rooms.open(1, "b", 0.0).status == KVPoll.FAILED
    assert rooms.rooms[1].rid == "a"


# ---------------------------------------------------------------------------------- decode side


def test_decode_handshake_moves_every_room_of_that_prefill_on():
    rooms = DecodeRooms(Timeouts())
    a, b = rooms.open(1, "a", "p:1", 100, 0.0), rooms.open(2, "b", "p:1", 100, 0.0)
    other = rooms.open(3, "c", "q:1", 100, 0.0)
    assert rooms.handshake("p:1", "tcp://p:9") == [a, b]
    assert a.status == b.status == KVPoll.WAITING_FOR_INPUT and other.status == KVPoll.BOOTSTRAPPING
    # Later rooms of a known prefill skip the handshake (SGLang's connection pool).
    assert rooms.open(4, "d", "p:1", 100, 1.0).status == KVPoll.WAITING_FOR_INPUT


def test_decode_handshake_gives_up_after_fifteen_attempts():
    rooms = DecodeRooms(Timeouts())
    state = rooms.open(1, "a", "p:1", 100, 0.0)
    for _ in range(HANDSHAKE_ATTEMPTS - 1):
        assert rooms.handshake("p:1", None) == []
    assert rooms.handshake("p:1", None) == [state]
    assert state.status == KVPoll.FAILED and state.stage == "handshake"
    assert decode_failure(state.stage, "a", 1, state.failure) == (
        "Decode handshake failed for request rank=0 decode_req.req.rid='a' decode_req.req.bootstrap_room=1 "
        "with exception KVTransferError(bootstrap_room=1): Aborted by AbortReq.")


def test_lost_prefill_fails_its_rooms_that_have_not_landed():
    rooms = DecodeRooms(Timeouts(heartbeat_max_failures=2))
    rooms.handshake("p:1", "tcp://p:9")
    waiting, sent, landed = (rooms.open(r, f"r{r}", "p:1", 10, 0.0) for r in (1, 2, 3))
    rooms.sent(2, 10, 0, 1.0)
    rooms.sent(3, 10, 0, 1.0)
    rooms.landed(3)
    elsewhere = rooms.open(4, "x", "q:1", 10, 0.0)
    assert rooms.heartbeat("p:1", False) == []
    assert rooms.heartbeat("p:1", True) == []  # a good poll resets the count
    assert rooms.heartbeat("p:1", False) == []
    assert rooms.heartbeat("p:1", False) == [waiting, sent]
    assert sent.failure == "Lost connection with prefill instance (bootstrap_addr: p:1)"
    assert (waiting.stage, sent.stage) == ("handshake", "transfer")
    assert landed.status == KVPoll.SUCCESS and elsewhere.active
    assert "p:1" not in rooms.watched()  # a later request handshakes again


def test_the_fake_peer_is_handshaken_at_once_and_never_heartbeaten():
    rooms = DecodeRooms(Timeouts())
    state = rooms.open(-1, "warm-up", FAKE, 10, 0.0)
    assert rooms.handshake(FAKE, FAKE) == [state] and state.status == KVPoll.WAITING_FOR_INPUT
    rooms.handshake("p:1", "tcp://p:9")
    assert rooms.watched() == ["p:1"]  # no /health of a peer that does not exist


def test_decode_waiting_timeout_counts_from_the_destination_sent():
    rooms = DecodeRooms(Timeouts(waiting_s=5))
    early, late = rooms.open(1, "a", "p:1", 10, 0.0), rooms.open(2, "b", "p:1", 10, 0.0)
    rooms.handshake("p:1", "tcp://p:9")
    rooms.sent(1, 10, 0, now=1.0)
    assert rooms.expired(5.9) == []
    assert rooms.expired(6.0) == [early]
    assert early.failure == "Request 1 timed out after 5.0s in KVPoll.WaitingForInput"
    assert late.status == KVPoll.WAITING_FOR_INPUT  # never sent: waiting for KV room has no deadline


def test_a_failed_transfers_kv_is_held_until_the_prefill_acknowledges_or_the_deadline():
    rooms = DecodeRooms(Timeouts(deferred_release_s=30))
    rooms.handshake("p:1", "tcp://p:9")
    sent, acked, unsent = (rooms.open(r, f"r{r}", "p:1", 10, 0.0) for r in (1, 2, 3))
    rooms.sent(1, 10, 2, now=1.0)
    rooms.sent(2, 7, 0, now=1.0)
    for state in (sent, acked, unsent):
        rooms.fail(state.room, ABORTED)
    assert rooms.hold(sent, (11, 12), now=2.0) and rooms.hold(acked, (), now=2.0)
    assert not rooms.hold(unsent, (), now=2.0)  # no destination sent: nothing the prefill could write into
    assert rooms.acknowledged(2) == Held(2, 7, (), 32.0)
    assert rooms.acknowledged(2) is None  # freed once
    assert rooms.overdue(31.9) == []
    assert rooms.overdue(32.0) == [Held(1, 10, (11, 12), 32.0)]  # no acknowledgement: freed anyway
    assert rooms.held == {}


def test_a_fake_transfer_or_an_immediate_release_holds_nothing():
    fake = DecodeRooms(Timeouts())
    state = fake.open(-1, "warm-up", FAKE, 10, 0.0)
    fake.handshake(FAKE, FAKE)
    fake.sent(-1, 10, 0, now=0.0)
    assert not fake.hold(state, (), now=0.0)
    immediate = DecodeRooms(Timeouts(deferred_release_s=None))
    immediate.handshake("p:1", "tcp://p:9")
    state = immediate.open(1, "a", "p:1", 10, 0.0)
    immediate.sent(1, 10, 0, now=0.0)
    assert not immediate.hold(state, (), now=0.0)


def test_preallocation_holds_back_the_reserved_decode_tokens():
    # 4,096 free; 3 requests running or in transfer hold back 512 each; a 500-token prompt needs 500 + 512.
    assert preallocation_fits(4096, 500, 0, 3, 512)
    assert not preallocation_fits(4096, 2100, 0, 3, 512)
    assert preallocation_fits(4096, 2100, 64, 3, 512)  # the decode engine's own cache holds 64 of them


def test_timeouts_come_from_sglangs_environment_with_its_floors():
    assert Timeouts.from_env({}) == Timeouts(300, 300, 5.0, 2)
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "7", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3",
           "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "0"}
    assert Timeouts.from_env(env) == Timeouts(7, 3, 2.0, 1)
    assert Timeouts.from_env({}).deferred_release_s == 30.0
    assert Timeouts.from_env({"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "4"}).deferred_release_s == 4
    assert Timeouts.from_env({"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "False"}).deferred_release_s is None


# ---------------------------------------------------------------------------------- the engine


def engine(**overrides) -> Engine:
    settings = {"fixed_step_ms": 10.0, "kv_capacity_tokens": 4096, "block_size": 4, "answer_length_median": 0}
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def run(e: Engine, steps: int = 50) -> list:
    updates = []
    for _ in range(steps):
        if not e.has_work:
            break
        updates += e.step().updates
    return updates


def test_a_held_request_is_not_scheduled_until_released():
    e = engine()
    e.add(Request("r", list(range(10)), SamplingParams(max_new_tokens=2)), held=True)
    assert not e.has_work and e.load().num_waiting_reqs == 0
    e.release("r")
    finished = [u for u in run(e) if u.finish_reason]
    assert finished and finished[0].num_output_tokens == 2


def test_a_transferred_request_continues_from_the_prefills_token_exactly_as_one_engine_would():
    prompt, sampling = list(range(40)), SamplingParams(max_new_tokens=6, temperature=0)
    whole = engine()
    whole.add(Request("a", prompt, sampling))
    expected = [u for u in run(whole) if u.finish_reason][0]

    prefill = engine()
    prefill.add(Request("a", prompt, SamplingParams(max_new_tokens=1, temperature=0)))
    first = [u for u in run(prefill) if u.finish_reason][0].request
    decode = engine(disaggregation_mode="decode")
    decode.add(Request("a", prompt, sampling), held=True)
    assert decode.cache.allocate(len(prompt))
    update = decode.start_transferred("a", (first.output_ids[0], first.text), 12, len(prompt))
    assert update.num_output_tokens == 1 and update.request.cached_tokens == 12
    done = [u for u in run(decode) if u.finish_reason][0]
    assert done.request.output_ids == expected.request.output_ids and done.text == expected.text
    assert decode.cache.used_tokens == 0  # its KV released, nothing cached: no prefix cache on decode


def test_the_given_first_token_is_used_even_if_this_engine_would_sample_another():
    e = engine(disaggregation_mode="decode")
    e.add(Request("a", list(range(8)), SamplingParams(max_new_tokens=3, temperature=0)), held=True)
    e.cache.allocate(8)
    update = e.start_transferred("a", (4242, " prefilled"), 0, 8)
    assert update.request.output_ids == [4242] and update.text == " prefilled"


def test_decode_role_has_no_prefix_cache_unless_asked():
    prompt = list(range(16))
    for config, cached in (({"disaggregation_mode": "decode"}, 0),
                           ({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True}, 12),
                           ({"disable_radix_cache": True}, 0), ({}, 12)):
        e = engine(**config)
        for rid in ("first", "second"):
            e.add(Request(rid, prompt, SamplingParams(max_new_tokens=1)))
            run(e)
        assert e.cached_tokens_total == cached, config
        assert bool(e.cache.drain_events()) == bool(cached), config


def test_prefill_role_refuses_the_fake_backend_as_sglang():
    with pytest.raises(ValueError, match="Prefill server does not support 'fake'"):
        EngineConfig(disaggregation_mode="prefill", disaggregation_transfer_backend="fake")
    with pytest.raises(ValueError, match="incompatible"):
        EngineConfig(disaggregation_mode="decode", disaggregation_transfer_backend="fake",
                     disaggregation_decode_enable_radix_cache=True)


def test_a_decode_engine_with_fewer_gpus_paces_the_transfer():
    rooms = prefill_rooms(tp=4)
    rooms.open(1, "a", 0.0)
    rooms.destination(1, "tcp://d:1", 0, 0.0, tp=1)
    assert rooms.finish(1, 1000, now=0.0) == pytest.approx(1000 * KV_BYTES / 50e9)  # one GPU's port


def test_a_decode_engine_restores_a_retracted_requests_kv_instead_of_recomputing_it():
    def transferred(e: Engine, rid: str) -> None:
        e.add(Request(rid, list(range(100)), SamplingParams(max_new_tokens=60, temperature=0)), held=True)
        assert e.cache.allocate(100)
        e.start_transferred(rid, None, 0, 100)

    roomy, tight = engine(disaggregation_mode="decode"), engine(disaggregation_mode="decode", kv_capacity_tokens=300)
    expected = {}
    for rid in ("a", "b"):
        transferred(roomy, rid)
        transferred(tight, rid)
    for u in run(roomy, 200):
        if u.finish_reason:
            expected[u.request.rid] = u.request.output_ids
    steps, prefilled, finished, backed_up = [], 0, {}, 0
    while tight.has_work and len(steps) < 400:
        backed_up = max(backed_up, sum(r.backed_up for r in tight.waiting))  # SGLang's retracted queue
        result = tight.step()
        steps.append(result.duration_s)
        prefilled += result.prefill_tokens
        finished.update({u.request.rid: u.request.output_ids for u in result.updates if u.finish_reason})
    assert tight.preemptions_total >= 1 and backed_up == 1  # 2 × (100 + 60) tokens do not fit in 300
    assert prefilled == 0  # a decode engine never prefills: the KV came back from host memory
    assert finished == expected
    # Each restore costs its copy: (100 + outputs so far) tokens × 163,840 B over 2 GPUs' PCIe at
    # 25 GB/s (0.33 ms per 100 tokens), on top of the steps' fixed 10 ms or on its own.
    restores = [d - 0.010 if d > 0.010 else d for d in steps if d != 0.010]
    assert len(restores) == tight.preemptions_total
    assert all(100 * KV_BYTES / (2 * 25e9) <= d <= 160 * KV_BYTES / (2 * 25e9) for d in restores)
