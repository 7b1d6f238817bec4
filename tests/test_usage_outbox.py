"""The durable usage outbox against a real nats-server that goes away and comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest

from inferbus.bus import connection as bus
from inferbus.bus.outbox import Outbox
from inferbus.bus.replies import Replies
from proto import messages as m
from proto import subjects

from .nats_server import NatsServer
from .waiting import await_for

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path / "nats")
    running.start()
    yield running
    running.stop()


ACME = subjects.usage_subject("acme", subjects.USAGE_FROM_WORKER, "w1")


def usage(request_id: str, tokens: int, **fields: object) -> m.UsageEvent:
    return m.UsageEvent(request_id=request_id, tenant="acme", model="m", status="completed",
                        usage=m.Usage(prompt_tokens=10, completion_tokens=tokens), started=time.time(),
                        finished=time.time(), **fields)  # type: ignore[arg-type]


async def ledger(url: str) -> list[m.UsageEvent]:
    nc = await nats.connect(url)
    try:
        found = []
        sub = await nc.jetstream().subscribe(subjects.usage_filter("acme"), ordered_consumer=True)
        try:
            while True:
                msg = await sub.next_msg(timeout=0.5)
                found.append(msgspec.msgpack.decode(msg.data, type=m.UsageEvent))
        except nats.errors.TimeoutError:
            pass
        return found
    finally:
        await nc.close()


async def test_usage_written_while_nats_is_down_is_published_once_it_is_back(
    server: NatsServer, tmp_path: Path
) -> None:
    nc = await bus.connect(server.url, name="test-outbox")
    await bus.ensure_streams(nc.jetstream())
    replies = Replies(nc)
    await replies.start()

    async def publish(subject: str, data: bytes, msg_id: str) -> None:
        await replies.publish_durable(subject, data, msg_id, timeout=0.5)

    outbox = Outbox(tmp_path / "state" / "outbox.sqlite3", publish, retry_min_s=0.05, retry_max_s=0.5)
    await outbox.start()
    await outbox.add(ACME, m.encode(usage("r0", 5)), "r0")
    assert await outbox.drained(5)

    server.stop()
    events = [usage(f"r{i}", i) for i in range(1, 21)]
    events.append(usage("r3", 99, billed_to="platform", attempt=0))  # another attempt's work: its own id
    await asyncio.gather(*(outbox.add(ACME, m.encode(e), m.usage_msg_id(e)) for e in events))
    # On disk, fsynced, while JetStream is away: nothing acknowledged, nothing dropped.
    assert outbox.pending() == 21
    await asyncio.sleep(1.0)
    assert outbox.pending() == 21

    server.start()
    await await_for(lambda: outbox.pending() == 0, 15, interval=0.1, what="the outbox drained")
    await outbox.stop()
    await nc.close()

    found = await ledger(server.url)
    ids = sorted(m.usage_msg_id(e) for e in found)
    assert ids == sorted(["r0", *(f"r{i}" for i in range(1, 21)), "r3.0.abandoned"])  # each exactly once
    assert (tmp_path / "state" / "outbox.sqlite3").stat().st_mode & 0o777 == 0o600


async def test_a_restart_republishes_what_was_pending_and_duplicates_are_dropped(
    server: NatsServer, tmp_path: Path
) -> None:
    path = tmp_path / "outbox.sqlite3"

    async def refuse(subject: str, data: bytes, msg_id: str) -> None:
        raise ConnectionError("NATS is away")

    crashed = Outbox(path, refuse, retry_min_s=0.05)
    await crashed.start()
    for i in range(5):
        await crashed.add(ACME, m.encode(usage(f"q{i}", i)), f"q{i}")
    await crashed.stop()  # the process ends with five events unpublished

    nc = await bus.connect(server.url, name="test-outbox")
    await bus.ensure_streams(nc.jetstream())
    replies = Replies(nc)
    await replies.start()
    # One of them had reached JetStream before the crash (published, not yet deleted locally).
    await replies.publish_durable(ACME, m.encode(usage("q2", 2)), "q2")

    async def publish(subject: str, data: bytes, msg_id: str) -> None:
        await replies.publish_durable(subject, data, msg_id)

    restarted = Outbox(path, publish)
    await restarted.start()
    await await_for(lambda: restarted.pending() == 0, 15, interval=0.1, what="the outbox drained")
    await restarted.stop()
    await nc.close()
    assert sorted(e.request_id for e in await ledger(server.url)) == [f"q{i}" for i in range(5)]


async def test_an_acknowledged_message_is_deleted_in_the_next_writes_commit(server: NatsServer, tmp_path: Path) -> None:
    nc = await bus.connect(server.url, name="test-outbox")
    await bus.ensure_streams(nc.jetstream())
    replies = Replies(nc)
    await replies.start()
    acknowledged: list[str] = []

    async def publish(subject: str, data: bytes, msg_id: str) -> None:
        await replies.publish_durable(subject, data, msg_id)
        acknowledged.append(msg_id)

    path = tmp_path / "outbox.sqlite3"
    # No delete commits on their own during the test: only a write takes deletes along.
    outbox = Outbox(path, publish, delete_delay_s=60)
    await outbox.start()
    await outbox.add(ACME, m.encode(usage("a0", 1)), "a0")
    await await_for(lambda: "a0" in acknowledged, 5, interval=0.01, what="a0 acknowledged")
    await asyncio.sleep(0.05)  # its delete is queued behind the acknowledgement
    assert outbox.pending() == 1  # acknowledged, its delete not committed yet
    await outbox.add(ACME, m.encode(usage("a1", 2)), "a1")
    assert await asyncio.to_thread(outbox.pending) == 1  # a1 written, a0 deleted in the same commit
    await await_for(lambda: "a1" in acknowledged, 5, interval=0.01, what="a1 acknowledged")
    await asyncio.sleep(0.05)
    await outbox.stop()  # commits the deletes still waiting
    reopened = Outbox(path, publish)
    await reopened.start()
    assert reopened.pending() == 0
    await reopened.stop()
    await nc.close()
    assert sorted(acknowledged) == ["a0", "a1"]  # nothing republished
