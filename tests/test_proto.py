import msgspec
import pytest

from proto import messages as m
from proto import subjects


def test_subject_tokens_escape_dots_and_wildcards() -> None:
    assert subjects.token("meta-llama/Llama-3.3-70B") == "meta-llama/Llama-3%2E3-70B"
    assert subjects.token("a*b>c d") == "a%2Ab%3Ec%20d"
    assert subjects.token("50%") == "50%25"
    with pytest.raises(ValueError):
        subjects.token("")


def test_request_subjects_for_any_and_worker_targets_do_not_overlap() -> None:
    reply_to = subjects.token_subject("gw")
    shared = subjects.request_subject("standard", "m.1", subjects.ANY_TARGET, reply_to)
    own = subjects.request_subject("standard", "m.1", subjects.worker_target("w1"), reply_to)
    assert shared == "inferbus.req.standard.m%2E1.any.gw"
    assert own == "inferbus.req.standard.m%2E1.w.w1.gw"
    assert subjects.request_filter("standard", "m.1") == "inferbus.req.standard.m%2E1.any.*"
    assert subjects.request_consumer("standard", "m.1") != subjects.request_consumer("standard", "m.1", "w1")
    assert "." not in subjects.request_consumer("standard", "m.1", "host.a")


def test_stream_batches_round_trip_through_the_tagged_union_in_order() -> None:
    final = m.Final(request_id="r", attempt=1, seq=3, text="!", finish_reason="length",
                    usage=m.Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=2))
    chunk = m.TokenChunk(request_id="s", attempt=0, seq=0, text="hi", completion_tokens=1, prompt_tokens=5)
    accepted = m.Accepted(request_id="s", attempt=0, worker_id="w", queue_wait=0.1)
    batch = m.StreamFrame(events=[accepted, chunk, final])
    assert m.decode_stream_frame(m.encode(batch)).events == [accepted, chunk, final]


def test_unknown_fields_from_newer_writers_are_ignored() -> None:
    newer = {"v": 2, "batch_note": "new", "events": [
        {"type": "chunk", "v": 2, "request_id": "r", "attempt": 0, "seq": 0, "text": "x",
         "completion_tokens": 1, "a_field_from_the_future": [1, 2]}]}
    [event] = m.decode_stream_frame(msgspec.msgpack.encode(newer)).events
    assert isinstance(event, m.TokenChunk) and event.v == 2


def test_engine_rids_are_fixed_length_so_prefix_abort_hits_one_request() -> None:
    request = m.InferenceRequest(request_id="a" * 32, tenant="t", model="m", prompt="p",
                                 sampling=m.SamplingParams(max_new_tokens=1), reply_to="x", deadline=0, created=0)
    rids = {msgspec.structs.replace(request, attempt=a).engine_rid() for a in range(12)}
    assert len(rids) == 12 and len({len(r) for r in rids}) == 1


def test_messages_written_with_the_old_tier_field_are_read_as_their_band():
    """`band` was called `tier` on the wire: a request, placement or usage event an older writer
    left in a stream keeps its band across the upgrade; new writers write `band` only."""

    old = msgspec.msgpack.encode({"request_id": "r1", "model": "m", "prompt_tokens": 5, "tier": "premium"})
    placement = m.decoder(m.PlacementRequest).decode(old)
    assert (placement.band, placement.tier) == ("premium", None)

    request = m.InferenceRequest(
        request_id="r1",
        tenant="t",
        model="m",
        prompt="p",
        sampling=m.SamplingParams(max_new_tokens=4),
        reply_to="x",
        deadline=1.0,
        created=0.0,
        band="batch",
    )
    written = msgspec.msgpack.decode(m.encode(request))
    assert written["band"] == "batch" and "tier" not in written
    written.pop("band")
    written["tier"] = "batch"
    assert m.decoder(m.InferenceRequest).decode(msgspec.msgpack.encode(written)).band == "batch"

    event = m.UsageEvent(
        request_id="r1",
        tenant="t",
        model="m",
        status="completed",
        usage=m.Usage(prompt_tokens=1, completion_tokens=1),
        started=0.0,
        finished=1.0,
        band="premium",
    )
    written = msgspec.msgpack.decode(m.encode(event))
    written["tier"] = written.pop("band")
    assert m.decoder(m.UsageEvent).decode(msgspec.msgpack.encode(written)).band == "premium"
