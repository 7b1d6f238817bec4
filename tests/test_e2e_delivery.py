"""A request delivered twice runs once: the second delivery is absorbed, never seen by the client.

Real JetStream deliveries on a real platform: the same attempt put in the stream twice (a publish
retried after the deduplication window) and a delivery whose attempt a live or a dead worker
already claimed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest

from proto import messages as m
from proto import subjects
from services.worker.claims import holder_name

from .conftest import MODEL, Platform, dispatch, read_usage, running_platform
from .waiting import await_for

pytestmark = pytest.mark.e2e

OWNER = "delivery-test"  # a gateway as far as the workers can tell: the requests' reply_to owner


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("delivery"), workers=2, time_scale=0.1) as running:
        yield running


def _request(max_tokens: int = 40) -> m.InferenceRequest:
    now = time.time()
    return m.InferenceRequest(
        request_id=uuid.uuid4().hex, tenant="demo", model=MODEL, prompt="Tell me about delivery.",
        sampling=m.SamplingParams(max_new_tokens=max_tokens, temperature=0.0), reply_to=subjects.token_subject(OWNER),
        deadline=now + 60, created=now, prompt_tokens=6, input_ids=[1, 2, 3, 4, 5, 6],
    )


def _absorbed_in_logs(platform: Platform, request_id: str) -> int:
    count = 0
    for name in ("worker-1", "worker-2"):
        for line in Path(platform.stack.get(name).log_path).read_text(errors="replace").splitlines():
            if "duplicate_delivery_absorbed" in line and request_id in line:
                count += 1
    return count


async def _deliver(platform: Platform, request: m.InferenceRequest, copies: int,
                   before: str | None = None) -> list[m.StreamEvent]:
    """Publish `copies` copies of `request` on the shared queue (distinct message ids, as a publish
    retried after the deduplication window); the stream events sent for it until its Final and
    every copy was taken (the rest absorbed)."""
    nc = await nats.connect(platform.stack.nats_url)
    js = nc.jetstream()
    events: list[m.StreamEvent] = []

    async def on_frame(msg: nats.aio.msg.Msg) -> None:
        frame = msgspec.msgpack.decode(msg.data, type=m.StreamFrame)
        events.extend(e for e in frame.events if e.request_id == request.request_id)

    sub = await nc.subscribe(subjects.event_filter(OWNER), cb=on_frame)
    try:
        if before is not None:  # the attempt is claimed already, by this holder
            claims = await js.key_value(subjects.CLAIMS_BUCKET)
            await claims.put(subjects.claim_key(request.request_id, request.attempt), before.encode())
        await dispatch(js, request)
        subject = subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, request.reply_to)
        for copy in range(copies):
            await js.publish(
                subject, m.encode(request.on_wire()), headers={"Nats-Msg-Id": f"{request.request_id}.{copy}"}
            )
        # Every copy ended: run to its Final, or absorbed (logged).
        await await_for(lambda: _absorbed_in_logs(platform, request.request_id) + _finals(events) >= copies, 60,
                        what="every copy run or absorbed")
        queued = -1
        for _ in range(300):  # and acked: none is left to be delivered again
            queued = (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages
            if queued == 0:
                break
            await asyncio.sleep(0.1)
        assert queued == 0, "a copy is still in the queue (not acked)"
    finally:
        await sub.unsubscribe()
        await nc.close()
    return events


def _runs(events: list[m.StreamEvent]) -> int:
    return sum(isinstance(e, m.Accepted) for e in events)


def _finals(events: list[m.StreamEvent]) -> int:
    return sum(isinstance(e, (m.Final, m.StreamError)) for e in events)


def test_two_copies_of_one_attempt_run_once_and_the_client_sees_one_stream(two_workers: Platform) -> None:
    request = _request()
    events = asyncio.run(_deliver(two_workers, request, copies=3))
    assert _runs(events) == 1
    assert not [e for e in events if isinstance(e, m.StreamError)]
    [final] = [e for e in events if isinstance(e, m.Final)]
    chunks = [e for e in events if isinstance(e, m.TokenChunk)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # one numbering: one run
    assert final.usage.completion_tokens == 40
    assert _absorbed_in_logs(two_workers, request.request_id) == 2
    [usage] = read_usage(two_workers, "demo", {request.request_id})
    assert usage.usage.completion_tokens == 40 and usage.billed_to == "tenant"


def test_an_attempt_a_live_worker_claimed_is_absorbed(two_workers: Platform) -> None:
    beat = asyncio.run(_heartbeat(two_workers, "worker-1"))
    request = _request()
    events = asyncio.run(_deliver(two_workers, request, copies=1, before=holder_name(beat.worker_id, beat.started)))
    assert events == []  # nothing reaches the client's gateway: no stream, no error
    assert _absorbed_in_logs(two_workers, request.request_id) == 1


def test_an_attempt_whose_claimer_died_runs(two_workers: Platform) -> None:
    request = _request()
    events = asyncio.run(_deliver(two_workers, request, copies=1, before=holder_name("worker-gone", 1.0)))
    assert _runs(events) == 1
    [final] = [e for e in events if isinstance(e, m.Final)]
    assert final.usage.completion_tokens == 40


async def _heartbeat(platform: Platform, worker_id: str) -> m.Heartbeat:
    nc = await nats.connect(platform.stack.nats_url)
    try:
        kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
        entry = await kv.get(subjects.worker_key(worker_id))
        assert entry.value
        return msgspec.msgpack.decode(entry.value, type=m.Heartbeat)
    finally:
        await nc.close()


def _refused_in_logs(platform: Platform, request_id: str) -> list[str]:
    return [line for name in ("worker-1", "worker-2")
            for line in Path(platform.stack.get(name).log_path).read_text(errors="replace").splitlines()
            if "undispatched_request" in line and request_id in line]


def test_a_worker_runs_only_what_a_gateway_dispatched(two_workers: Platform) -> None:
    """What the router's recovery right allows, a request on the shared queue for any owner and
    tenant, runs nowhere unless a gateway dispatched it so: no record, or a record for another
    tenant or owner, is refused (a security event in the worker's log, the message terminated,
    nothing streamed). Control: with the gateway's record it runs."""
    async def scenario() -> tuple[list[str], list[m.StreamEvent]]:
        nc = await nats.connect(two_workers.stack.nats_url)
        js = nc.jetstream()
        events: list[m.StreamEvent] = []

        async def on_frame(msg: nats.aio.msg.Msg) -> None:
            events.extend(msgspec.msgpack.decode(msg.data, type=m.StreamFrame).events)

        sub = await nc.subscribe(subjects.event_filter(OWNER), cb=on_frame)
        forged = [_request(), _request(), _request()]
        await dispatch(js, msgspec.structs.replace(forged[1], tenant="globex"))  # dispatched for another tenant
        await dispatch(js, msgspec.structs.replace(forged[2], reply_to=subjects.token_subject("other-gateway")))
        try:
            for request in forged:  # forged[0]: dispatched by nobody
                subject = subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, request.reply_to)
                await js.publish(subject, m.encode(request.on_wire()), headers={"Nats-Msg-Id": request.request_id})
            refused = await await_for(
                lambda: (
                    [r.request_id for r in forged if _refused_in_logs(two_workers, r.request_id)]
                    if all(_refused_in_logs(two_workers, r.request_id) for r in forged)
                    else None
                ),
                30,
                what="every forged request refused",
            )
            # Terminated, not redelivered (the worker logs its refusal, then terminates the message).
            async def stream_empty() -> bool:
                return (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages == 0

            await await_for(stream_empty, 30, what="the forged requests terminated")
        finally:
            await sub.unsubscribe()
            await nc.close()
        return refused, [e for e in events if e.request_id in {r.request_id for r in forged}]

    refused, streamed = asyncio.run(scenario())
    assert len(refused) == 3 and streamed == []
    reasons = [_refused_in_logs(two_workers, request_id)[0] for request_id in refused]
    assert ["not_dispatched" in reasons[0], "dispatched_for_another_tenant" in reasons[1],
            "dispatched_to_another_owner" in reasons[2]] == [True, True, True]
    control = _request()  # the same kind of request, dispatched by its gateway: it runs
    events = asyncio.run(_deliver(two_workers, control, copies=1))
    assert _runs(events) == 1 and not _refused_in_logs(two_workers, control.request_id)
