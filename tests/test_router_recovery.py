"""Moving a dead worker's queue (services/router/recovery.py) against a real nats-server: what
one pass moves is counted even when the pass cannot finish, and the queue is deleted only once
it is empty, so nothing queued is stranded."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo
from nats.js.errors import NotFoundError

from inferbus.bus import connection as bus
from inferbus.bus.replies import Replies
from proto import subjects
from services.router import recovery

pytestmark = pytest.mark.slow

MODEL = "m"
WORKER = "w1"


async def worker_queue(nc: Client, worker: str, ack_wait: float) -> str:
    """A worker's own request queue (its durable consumer), as the worker creates it; its name."""
    js = nc.jetstream()
    await bus.ensure_streams(js)
    name = subjects.request_consumer("standard", MODEL, worker)
    await js.add_consumer(subjects.REQUESTS_STREAM, ConsumerConfig(
        durable_name=name, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, max_ack_pending=-1,
        filter_subject=subjects.request_filter("standard", MODEL, subjects.worker_target(worker))))
    return name


async def test_a_pass_that_cannot_finish_counts_what_it_moved_and_leaves_the_rest_queued(nc: Client) -> None:
    js = nc.jetstream()
    worker_consumer = await worker_queue(nc, WORKER, ack_wait=2.0)
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


async def test_a_pass_stops_when_its_worker_comes_back_and_leaves_it_what_was_placed_on_it(nc: Client) -> None:
    """A worker restarted under its own id returns to the same consumer while a pass is still
    moving its queue: what was queued before it came back goes to the shared queue, what the pass
    holds when it sees the worker alive goes back to the worker, and the consumer stays."""
    js = nc.jetstream()
    worker_consumer = await worker_queue(nc, "w2", ack_wait=30.0)
    shared = await js.pull_subscribe(subjects.request_filter("standard", MODEL), durable="shared-2",
                                     stream=subjects.REQUESTS_STREAM)
    queued = subjects.request_subject("standard", MODEL, subjects.worker_target("w2"), subjects.token_subject("g1"))
    await js.publish(queued, b"before", headers={"Nats-Msg-Id": "before"})
    replies = Replies(nc)
    await replies.start()
    info = await js.consumer_info(subjects.REQUESTS_STREAM, worker_consumer)
    alive = False
    checks = 0

    def revived() -> bool:
        # Dead for the first fetch; alive from the moment after the second (placed on it again).
        nonlocal checks
        checks += 1
        return alive

    async def placed_again() -> None:
        nonlocal alive
        for _ in range(1000):  # until the first fetch is done and the second started (10 s at most)
            if checks >= 3:
                break
            await asyncio.sleep(0.01)
        await js.publish(queued, b"after", headers={"Nats-Msg-Id": "after"})
        alive = True

    placing = asyncio.ensure_future(placed_again())
    result = await recovery.recover(js, replies, info, give_up_after_s=20.0, revived=revived)
    await placing
    assert result == recovery.Recovered(1, False, recovery.REVIVED)
    moved = await shared.fetch(10, timeout=2)
    assert [m.headers["Nats-Msg-Id"] for m in moved] == ["before.recovered"]
    # The worker's consumer is still there, and holds the request placed on it after it came back,
    # delivered now (given back), not after the 30 s ack wait.
    back = await js.pull_subscribe_bind(worker_consumer, subjects.REQUESTS_STREAM)
    [mine] = await back.fetch(1, timeout=5)
    assert mine.data == b"after"
    await mine.ack()
    await replies.stop()


async def empty_queue(nc: Client, worker: str) -> tuple[str, Replies, ConsumerInfo]:
    """A worker's own queue with nothing in it, a started `Replies` to recover it with, and its
    state as the router's scan would see it."""
    worker_consumer = await worker_queue(nc, worker, ack_wait=30.0)
    replies = Replies(nc)
    await replies.start()
    return worker_consumer, replies, await nc.jetstream().consumer_info(subjects.REQUESTS_STREAM, worker_consumer)


async def test_an_empty_queue_whose_worker_came_back_is_not_deleted(nc: Client) -> None:
    js = nc.jetstream()
    worker_consumer, replies, info = await empty_queue(nc, "w3")
    checks = iter([False, True])  # dead at the fetch (it finds the queue empty), alive before the delete
    result = await recovery.recover(js, replies, info, give_up_after_s=20.0, revived=lambda: next(checks, True))
    assert result == recovery.Recovered(0, False, recovery.REVIVED)
    assert (await js.consumer_info(subjects.REQUESTS_STREAM, worker_consumer)).name == worker_consumer
    await replies.stop()


class _Stalling:
    """A JetStream context whose second `consumer_info` times out, as on a busy server, or whose
    subscription's first `fetch` does: nats-py raises its own TimeoutError from most waits, but
    a plain `asyncio.TimeoutError` when a fetch's time ran out before its second pull request."""

    def __init__(self, js: object, call: str) -> None:
        self.js, self.call, self.calls = js, call, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.js, name)

    async def consumer_info(self, *args: object, **kwargs: object) -> object:
        if self.call == "consumer_info":
            self.calls += 1
            if self.calls == 2:
                raise NatsTimeoutError
        return await self.js.consumer_info(*args, **kwargs)  # type: ignore[attr-defined]

    async def pull_subscribe_bind(self, *args: object, **kwargs: object) -> object:
        subscription = await self.js.pull_subscribe_bind(*args, **kwargs)  # type: ignore[attr-defined]
        if self.call != "fetch":
            return subscription
        stalling = self

        class Subscription:
            def __getattr__(self, name: str) -> object:
                return getattr(subscription, name)

            async def fetch(self, *args: object, **kwargs: object) -> object:
                stalling.calls += 1
                if stalling.calls == 1:
                    raise asyncio.TimeoutError
                return await subscription.fetch(*args, **kwargs)

        return Subscription()


@pytest.mark.parametrize("call", ["consumer_info", "fetch"])
async def test_a_jetstream_call_timing_out_mid_pass_is_asked_again_not_the_end_of_the_pass(nc: Client,
                                                                                          call: str) -> None:
    js = nc.jetstream()
    worker_consumer, replies, info = await empty_queue(nc, f"w4-{call}")
    stalling = _Stalling(js, call)
    result = await recovery.recover(stalling, replies, info, give_up_after_s=20.0)  # type: ignore[arg-type]
    # consumer_info: the one before the pass, the one that timed out, the one asked again; fetch:
    # the one that timed out, taken as an empty batch (consumer_info then finds the queue drained).
    assert stalling.calls == (3 if call == "consumer_info" else 1)
    assert result == recovery.Recovered(0, True)  # drained and deleted in this pass
    with pytest.raises(NotFoundError):
        await js.consumer_info(subjects.REQUESTS_STREAM, worker_consumer)
    await replies.stop()
