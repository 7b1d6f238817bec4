"""`flush` returns only once the server has read everything written before it: a subscription
made and flushed on one connection gets every message another connection publishes next."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from inferbus.bus import connection as bus

pytestmark = pytest.mark.slow


def recording(nc: Client) -> list[bytes]:
    """What `nc` hands its socket, in order."""
    written: list[bytes] = []
    transport = nc._transport
    assert transport is not None
    write, writelines = transport.write, transport.writelines

    def record(data: bytes) -> None:
        written.append(bytes(data))
        write(data)

    def record_lines(lines: list[bytes]) -> None:
        written.extend(bytes(line) for line in lines)
        writelines(lines)

    transport.write = record  # type: ignore[method-assign,assignment]
    transport.writelines = record_lines  # type: ignore[method-assign,assignment]
    return written


async def test_a_flush_goes_out_behind_the_subscription_it_follows(nc: Client) -> None:
    written = recording(nc)
    await nc.subscribe("ordered")
    await nc.flush()
    commands = [line.split(b" ")[0].strip() for line in written]
    # nats-py's own flush writes the PING first, while the SUB still waits in its pending buffer.
    assert commands.index(b"SUB") < commands.index(b"PING"), commands


async def test_a_flushed_subscription_hears_the_next_message_from_another_connection(nc: Client) -> None:
    url = nc.connected_url
    assert url is not None
    sender = await bus.connect(f"nats://{url.hostname}:{url.port}", name="test-sender")
    try:
        for round_ in range(20):
            heard = asyncio.Event()

            async def on_message(msg: object, heard: asyncio.Event = heard) -> None:
                heard.set()

            subject = f"ordered.{round_}"
            sub = await nc.subscribe(subject, cb=on_message)
            await nc.flush()
            await sender.publish(subject, b"x")
            await sender.flush()
            await asyncio.wait_for(heard.wait(), 5)
            await sub.unsubscribe()
    finally:
        await sender.close()
