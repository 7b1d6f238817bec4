"""Two attempts of one request on one worker, on a real bus with a real engine: attempt 0 is
streaming when attempt 1 reaches the same worker, and no cancel for attempt 0 ever came (a worker
killed and restarted under its own id takes over attempt 0's redelivery after the gateway's cancel
went to the dead process, then is handed attempt 1). The worker gives attempt 0 up for attempt 1:
the client gets attempt 1's answer, the tenant is billed for attempt 1 alone, and attempt 0's work
is the platform's (`services/worker/attempt.py`, `give_up_earlier`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest

from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, gateway_in_process, platform_on_open_bus

pytestmark = pytest.mark.e2e

GATEWAY = "test-gateway"


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with platform_on_open_bus(tmp_path_factory, "overlap", workers=1) as platform:
        yield platform


async def overlap(platform: Platform, request_id: str) -> tuple[str, int, int, list[m.UsageEvent]]:
    """Attempt 0 through a dispatcher in this process; at its first token, attempt 1 published
    straight to the worker holding attempt 0, with no cancel. Attempt 1's text and tokens, the
    attempt the dispatcher ended on, and the request's usage events once both attempts reported."""
    async with gateway_in_process(platform, GATEWAY, workers=1) as (nc, dispatcher):
        now = time.time()
        request = m.InferenceRequest(request_id=request_id, tenant="demo", model=MODEL,
                                     prompt="Tell me a long story about the sea",
                                     reply_to=subjects.token_subject(GATEWAY), created=now, deadline=now + 120,
                                     sampling=m.SamplingParams(max_new_tokens=400, temperature=0, seed=7))
        flight = await dispatcher.open(request)
        text: list[str] = []
        tokens = 0
        async for event in dispatcher.events(flight):
            if flight.request.attempt == 0 and isinstance(event, m.TokenChunk) and flight.worker_id:
                # Attempt 1 to attempt 0's worker, as the gateway would after giving attempt 0 up,
                # but with no cancel: the worker has only the two attempts to go on.
                later = flight.request = msgspec.structs.replace(flight.request, attempt=1)
                subject = subjects.request_subject(later.band, later.model, subjects.worker_target(flight.worker_id),
                                                   later.reply_to)
                await dispatcher.replies.publish_durable(subject, m.encode(later.on_wire()),
                                                         f"{request_id}.{later.attempt}")
                continue
            assert isinstance(event, (m.TokenChunk, m.Final)), event
            text.append(event.text)
            tokens = event.completion_tokens if isinstance(event, m.TokenChunk) else tokens
            if isinstance(event, m.Final):
                tokens = event.usage.completion_tokens
        attempt = flight.request.attempt

        events: list[m.UsageEvent] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(events) < 2:
            events = []
            sub = await nc.jetstream().subscribe(subjects.usage_filter("demo"), ordered_consumer=True)
            try:
                while True:
                    msg = await sub.next_msg(timeout=0.5)
                    usage = msgspec.msgpack.decode(msg.data, type=m.UsageEvent)
                    if usage.request_id == request_id:
                        events.append(usage)
            except Exception:
                pass
            await sub.unsubscribe()
    return "".join(text), tokens, attempt, events


def test_a_later_attempt_on_the_same_worker_gives_the_earlier_up_and_only_it_is_billed(one_worker: Platform) -> None:
    text, tokens, attempt, events = asyncio.run(overlap(one_worker, "overlapping-attempts"))
    assert attempt == 1 and text and tokens == 400
    by_attempt = {(event.attempt, event.billed_to): event for event in events}
    assert set(by_attempt) == {(0, "platform"), (1, "tenant")}, [(e.attempt, e.billed_to, e.status) for e in events]
    # The tenant's one event is what its client got from attempt 1; attempt 0 stopped early.
    assert by_attempt[(1, "tenant")].status == "completed"
    assert by_attempt[(1, "tenant")].usage.completion_tokens == tokens
    assert by_attempt[(0, "platform")].usage.completion_tokens < tokens
