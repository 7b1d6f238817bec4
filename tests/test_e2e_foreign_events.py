"""A worker speaking for a stream another worker runs: two workers on a real bus, a request in
flight on one, and the other's events for that request (a `Handoff`, an `Accepted`, a `Final`
with `stop` and one token of usage, each naming the sender; a chunk and a `content_filter` error
that name nobody; a `Final` naming the holder) published on the gateway's token subject under
the other worker's own name (`inferbus.tok.<gateway>.<worker>`). The gateway refuses them all (a
`foreign_token_event` security event each) and the client's stream is the one it would have got."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, gateway_in_process, platform_on_open_bus

pytestmark = pytest.mark.e2e

GATEWAY = "test-gateway"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with platform_on_open_bus(tmp_path_factory, "foreign", workers=2) as platform:
        yield platform


def foreign_events() -> float:
    return REGISTRY.get_sample_value("inferbus_security_events_total", {"kind": "foreign_token_event"}) or 0.0


async def relay(platform: Platform, request_id: str, inject: bool) -> tuple[str, str, int, str | None]:
    """One request through a dispatcher in this process; with `inject`, once its holder is known,
    the other worker's forged events. The text, the finish reason, the attempt and the holder."""
    async with gateway_in_process(platform, GATEWAY, workers=2) as (nc, dispatcher):
        now = time.time()
        request = m.InferenceRequest(request_id=request_id, tenant="demo", model=MODEL, prompt="Tell me about the sea",
                                     reply_to=subjects.token_subject(GATEWAY), created=now, deadline=now + 60,
                                     sampling=m.SamplingParams(max_new_tokens=120, temperature=0, seed=7))
        flight = await dispatcher.open(request)
        text, finish = [], ""
        async for event in dispatcher.events(flight):
            if inject and isinstance(event, m.TokenChunk) and flight.worker_id:
                inject = False
                other = next(w for w in dispatcher.live_workers if w != flight.worker_id)
                forged: list[m.StreamEvent] = [
                    m.Handoff(request_id=request_id, attempt=0, worker_id=other),
                    m.Accepted(request_id=request_id, attempt=0, worker_id=other, queue_wait=0.0),
                    m.Final(
                        request_id=request_id,
                        attempt=0,
                        seq=flight.next_seq,
                        text=" INJECTED",
                        finish_reason="stop",
                        usage=m.Usage(prompt_tokens=1, completion_tokens=1),
                        worker_id=other,
                    ),
                    # Events that name no worker, or the holder: caught by who published them.
                    m.TokenChunk(
                        request_id=request_id, attempt=0, seq=flight.next_seq, text=" INJECTED", completion_tokens=1
                    ),
                    m.StreamError(
                        request_id=request_id,
                        attempt=0,
                        code="content_filter",
                        message="forged",
                        retryable=False,
                        status=400,
                    ),
                    m.Final(
                        request_id=request_id,
                        attempt=0,
                        seq=flight.next_seq,
                        text=" INJECTED",
                        finish_reason="stop",
                        usage=m.Usage(prompt_tokens=1, completion_tokens=1),
                        worker_id=flight.worker_id,
                    ),
                ]
                # Published as the other worker: the last token of the subject is the publisher's
                # (NATS permissions bind it to the worker's identity).
                await nc.publish(subjects.event_subject(subjects.token_subject(GATEWAY), other),
                                 m.encode(m.StreamFrame(events=forged)))
            assert isinstance(event, (m.TokenChunk, m.Final)), event
            text.append(event.text)
            if isinstance(event, m.Final):
                finish = event.finish_reason
        return "".join(text), finish, flight.request.attempt, flight.worker_id


def test_a_worker_cannot_speak_for_a_stream_another_worker_runs(two_workers: Platform) -> None:
    expected, finish, attempt, _ = asyncio.run(relay(two_workers, "clean", inject=False))
    assert finish == "length" and attempt == 0 and expected
    before = foreign_events()
    text, finish, attempt, holder = asyncio.run(relay(two_workers, "attacked", inject=True))
    # No migration (the forged Handoff), no other holder (the forged Accepted), no early stop or
    # injected text (the forged Final): the text a clean run gives.
    assert (text, finish, attempt) == (expected, "length", 0)
    assert holder is not None
    assert foreign_events() == before + 6
