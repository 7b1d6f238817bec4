"""Recovery of a dead worker's queued work.

A request placed on a worker waits in that worker's own subject (`…​.w.<worker>`) until the
worker pulls it. When the worker dies, the router moves whatever is still queued there to the
shared subject of the same band and model, where any worker takes it, and deletes the dead
worker's consumers. Each moved message is published with the id `<original id>.recovered`, so
two router replicas recovering the same worker, or one retrying after a crash between publish and
ack, never queue a request twice. Requests the worker had already accepted are not here: the
gateway holding the client migrates those.

The gateway does not republish a queued request itself when its worker dies: the queue is the
truth, and moving the message (instead of publishing a second attempt) is what guarantees the
request runs once.

A worker restarted under its own id (the local supervisor, a drill) comes back to the same
consumer, and requests are placed on it again as soon as its heartbeat is seen. A pass still
running then would take them from the worker's consumer and move them to the shared queue, where
a worker of another release, without their cached prefix or adapter, takes them (an eval pinned
to a release scored the other release's answers). So the pass asks `revived` before every fetch
and after it: once the worker is back it gives back what it holds (`nak`, redelivered to the
worker at once) and stops, leaving the consumer to its worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import NamedTuple

from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from inferbus.bus.replies import Replies
from inferbus.runtime import logs
from proto import subjects

log = logs.get(__name__)

FETCH_BATCH = 256
FETCH_WAIT_S = 1.0  # nats-py's fetch does not deliver with much shorter waits
REVIVED = "its worker is alive again"


async def worker_consumers(js: JetStreamContext) -> list[tuple[str, ConsumerInfo]]:
    """Every worker-owned request consumer, with the worker token from its filter subject."""
    found = []
    for info in await js.consumers_info(subjects.REQUESTS_STREAM):
        worker = subjects.worker_of_request_subject(info.config.filter_subject or "")
        if worker is not None:
            found.append((worker, info))
    return found


class Recovered(NamedTuple):
    moved: int  # requests moved to the shared subject by this pass
    drained: bool  # nothing left: the consumer was deleted
    error: str = ""  # why the pass stopped early, if it did


async def recover(js: JetStreamContext, replies: Replies, info: ConsumerInfo, *, give_up_after_s: float,
                  revived: Callable[[], bool] = lambda: False) -> Recovered:
    """Move everything queued on a dead worker's consumer to the shared subject, until `revived()`
    says its worker is alive again.

    Messages the worker pulled but never acked come back after the consumer's ack wait, so this
    keeps fetching until nothing is pending or outstanding, for at most `give_up_after_s`. The
    consumer is deleted only once it is drained: a pass that ran out of time or met an error (a
    JetStream call timing out on a busy server) leaves the rest to the next scan, and says how
    many it had moved already.
    """
    durable = info.name
    if subjects.worker_of_request_subject(info.config.filter_subject or "") is None:
        return Recovered(0, False)
    moved = 0
    deadline = time.monotonic() + give_up_after_s
    try:
        await js.consumer_info(subjects.REQUESTS_STREAM, durable)  # binding does not check
    except NotFoundError:
        return Recovered(0, True)  # deleted since the scan (another router replica)
    subscription = await js.pull_subscribe_bind(durable, subjects.REQUESTS_STREAM)
    try:
        while time.monotonic() < deadline:
            if revived():
                return Recovered(moved, False, REVIVED)
            try:
                batch = await subscription.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
            except TimeoutError:  # nats-py's own, or asyncio's when its wait ran out between pull requests
                batch = []
            if batch and revived():
                for msg in batch:
                    await msg.nak()  # the worker's again: redelivered to it now, not after the ack wait
                return Recovered(moved, False, REVIVED)
            for msg in batch:
                # The same owner (last token) on the shared subject: its replies still go there.
                shared = subjects.shared_request_subject(msg.subject)
                if shared is None:
                    await msg.term()
                    continue
                headers = dict(msg.headers or {})
                original_id = headers.pop("Nats-Msg-Id", None) or f"seq-{msg.metadata.sequence.stream}"
                await replies.publish_durable(shared, msg.data, f"{original_id}.recovered", headers=headers or None)
                await msg.ack()
                moved += 1
            if batch:
                continue
            try:
                state = await js.consumer_info(subjects.REQUESTS_STREAM, durable)
            except TimeoutError:  # (nats-py's TimeoutError is one too)
                continue  # a busy server: ask again, within the pass's time
            if state.num_pending == 0 and state.num_ack_pending == 0:
                break
            await asyncio.sleep(0.2)
        else:
            return Recovered(moved, False, f"still queued after {give_up_after_s:.0f} s")
        if revived():  # empty, and its worker's again: deleting it would pull the queue from under it
            return Recovered(moved, False, REVIVED)
        await js.delete_consumer(subjects.REQUESTS_STREAM, durable)
        return Recovered(moved, True)
    except NotFoundError:
        return Recovered(moved, True)  # deleted meanwhile (another router replica)
    except Exception as error:
        # Unacknowledged messages stay queued; a republished one that was stored keeps its id, so
        # moving it again next pass is deduplicated.
        return Recovered(moved, False, repr(error))
    finally:
        try:
            await subscription.unsubscribe()
        except Exception:
            pass  # the connection is gone: so is the subscription
