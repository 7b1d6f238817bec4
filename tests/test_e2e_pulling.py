"""Free slots pull whenever work waits for them, whatever the band's place in the pull order.

One worker with 16 slots and five consumers (premium own/shared, standard own/shared, batch):
standard requests put on the shared queue in two waves, the second while the first runs, all
start while the premium queues stay empty. Before the pull plan, the idle premium consumers'
long-polls took a fair share each of the free slots, and standard requests waited beside them.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Iterator

import msgspec
import nats
import pytest

from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, dispatch, running_platform
from .waiting import await_for

pytestmark = pytest.mark.e2e

OWNER = "pulling-test"
SLOTS = 16


@pytest.fixture(scope="module")
def sixteen_slots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("pulling"), workers=1, time_scale=1.0,
                          extra_env={"INFERBUS_WORKER_MAX_RUNNING": str(SLOTS)}) as running:
        yield running


def _request() -> m.InferenceRequest:
    now = time.time()
    return m.InferenceRequest(
        request_id=uuid.uuid4().hex, tenant="demo", model=MODEL, prompt="Tell me about pulling.",
        sampling=m.SamplingParams(max_new_tokens=4000, temperature=0.0), reply_to=subjects.token_subject(OWNER),
        deadline=now + 300, created=now, prompt_tokens=6, input_ids=[1, 2, 3, 4, 5, 6],
    )


def _at_least(found: set[str], count: int) -> bool:
    return len(found) >= count


def test_every_free_slot_takes_waiting_standard_work(sixteen_slots: Platform) -> None:
    async def scenario() -> tuple[int, int]:
        nc = await nats.connect(sixteen_slots.stack.nats_url)
        js = nc.jetstream()
        accepted: set[str] = set()
        finished: set[str] = set()

        async def on_frame(msg: nats.aio.msg.Msg) -> None:
            for event in msgspec.msgpack.decode(msg.data, type=m.StreamFrame).events:
                if isinstance(event, m.Accepted):
                    accepted.add(event.request_id)
                elif isinstance(event, (m.Final, m.StreamError)):
                    finished.add(event.request_id)

        sub = await nc.subscribe(subjects.event_filter(OWNER), cb=on_frame)
        subject = subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, subjects.token_subject(OWNER))
        ids: list[str] = []
        try:
            for wave in (10, SLOTS - 10):  # ten running, then six more for the six free slots
                for _ in range(wave):
                    request = _request()
                    ids.append(request.request_id)
                    await dispatch(js, request)
                    await js.publish(subject, m.encode(request.on_wire()), headers={"Nats-Msg-Id": request.request_id})
                await await_for(
                    functools.partial(_at_least, accepted, len(ids)), 20, what=f"{len(ids)} requests started"
                )
            return len(accepted), len(finished)
        finally:
            for request_id in ids:  # leave nothing running for the next test
                await nc.publish(subjects.cancel_subject(OWNER, request_id), m.encode(m.Cancel(request_id=request_id)))
            await sub.unsubscribe()
            await nc.close()

    started, finished = asyncio.run(scenario())
    assert started == SLOTS
    assert finished == 0  # all sixteen ran at once: none waited for another to end
