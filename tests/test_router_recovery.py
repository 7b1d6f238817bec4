"""Moving a dead worker's queue (services/router/recovery.py) against a real nats-server: what
one pass moves is counted even when the pass cannot finish, and the queue is deleted only once
it is empty, so nothing queued is stranded."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from inferbus.bus import connection as bus
from inferbus.bus.replies import Replies
from proto import subjects
from services.router import recovery

pytestmark = pytest.mark.slow

MODEL = "m"
WORKER = "w1"



async def test_a_pass_that_cannot_finish_counts_what_it_moved_and_leaves_the_rest_queued(nc: Client) -> None:
    js = nc.jetstream()
    await bus.ensure_streams(js)
    worker_consumer = subjects.request_consumer("standard", MODEL, WORKER)
    await js.add_consumer(subjects.REQUESTS_STREAM, ConsumerConfig(
        durable_name=worker_consumer, ack_policy=AckPolicy.EXPLICIT, ack_wait=2.0, max_ack_pending=-1,
        filter_subject=subjects.request_filter("standard", MODEL, subjects.worker_target(WORKER))))
    shared = await js.pull_subscribe(subjects.request_filter("standard", MODEL), durable="shared",
                                     stream=subjects.REQUESTS_STREAM)
    queued = subjects.request_subject("standard", MODEL, subjects.worker_target(WORKER), subjects.token_subject("g1"))
    for i in range(3):
        await js.publish(queued, f"request {i}".encode(), headers={"Nats-Msg-Id": f"r{i}"})
    # The worker pulled one before it hung: it comes back only after the ack wait.
    hung = await js.pull_subscribe_bind(worker_consumer, subjects.REQUESTS_STREAM)
    [held] = await hung.fetch(1, timeout=2)
    replies = Replies(nc)
    await replies.start()
    info = await js.consumer_info(subjects.REQUESTS_STREAM, worker_consumer)

    first = await recovery.recover(js, replies, info, give_up_after_s=1.0)
    # Why it stopped depends on the machine's speed: the held one still queued, or the wait for
    # it running out; either way what it moved is counted and the held one stays.
    assert first.moved == 2 and not first.drained and first.error
    assert (await js.consumer_info(subjects.REQUESTS_STREAM, worker_consumer)).num_ack_pending == 1  # kept

    second = await recovery.recover(js, replies, info, give_up_after_s=10.0)  # after the ack wait
    assert second == recovery.Recovered(1, True)
    with pytest.raises(NotFoundError):
        await js.consumer_info(subjects.REQUESTS_STREAM, worker_consumer)
    moved = await shared.fetch(10, timeout=2)
    assert sorted(m.headers["Nats-Msg-Id"] for m in moved) == ["r0.recovered", "r1.recovered", "r2.recovered"]
    assert {m.subject for m in moved} == {subjects.shared_request_subject(held.subject)}
    assert await recovery.recover(js, replies, info, give_up_after_s=1.0) == recovery.Recovered(0, True)
    await replies.stop()
