"""Requests waiting in JetStream: a worker with one slot makes the queue observable."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import nats
import pytest

from proto import subjects

from .conftest import MODEL, Platform, read_usage, running_platform
from .waiting import await_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("queue"), workers=1, time_scale=0.1,
                             extra_env={"INFERBUS_WORKER_MAX_RUNNING": "1"}) as running:
        yield running


async def _in_jetstream(platform: Platform) -> bool:
    """A request message waits in JetStream (the work queue keeps one until a worker acks it)."""
    nc = await nats.connect(platform.stack.nats_url)
    try:
        info = await nc.jetstream().stream_info(subjects.REQUESTS_STREAM)
        return info.state.messages >= 1
    finally:
        await nc.close()


def _logged_end(platform: Platform, request_id: str, status: int) -> bool:
    """The gateway's access log has `request_id`'s line with `status`."""
    path = platform.stack.config.state_dir / "logs" / "gateway.log"
    for line in path.read_bytes().splitlines():
        if request_id.encode() in line and b'"event": "request"' in line.replace(b'":"', b'": "'):
            return json.loads(line).get("status") == status
    return False


async def _stream(session: aiohttp.ClientSession, platform: Platform, max_tokens: int, ids: list[str],
                  chunks: list[int]) -> None:
    async with session.post(f"{platform.base_url}/chat/completions",
                            headers={"authorization": f"Bearer {platform.api_key}"},
                            json={"model": MODEL, "messages": [{"role": "user", "content": "queue"}],
                                  "max_tokens": max_tokens, "stream": True}) as response:
        ids.append(response.headers["x-request-id"])
        async for _ in response.content:
            chunks.append(1)


def test_a_request_cancelled_while_queued_is_never_generated(one_slot: Platform) -> None:
    running_ids: list[str] = []
    queued_ids: list[str] = []
    running_chunks: list[int] = []
    queued_chunks: list[int] = []

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            holder = asyncio.create_task(_stream(session, one_slot, 30000, running_ids, running_chunks))
            await await_for(lambda: running_chunks, 30, interval=0.01, what="the first stream's first chunk")
            # It holds the worker's only slot.
            waiter = asyncio.create_task(_stream(session, one_slot, 50, queued_ids, queued_chunks))
            # Accepted by the gateway, queued in JetStream.
            await await_for(lambda: queued_ids, 30, interval=0.01, what="the second request accepted")
            await await_for(lambda: _in_jetstream(one_slot), 30, what="the second request waiting in JetStream")
            waiter.cancel()  # its client leaves while it is still queued
            # The gateway has published the cancel once it logs the request's end (499); the
            # holder's cancel, published after it on the same connection, reaches the worker after it.
            await await_for(lambda: _logged_end(one_slot, queued_ids[0], 499), 30,
                            what="the gateway's end of the cancelled request")
            holder.cancel()  # frees the slot: the worker now pulls the cancelled request
            await asyncio.gather(holder, waiter, return_exceptions=True)

    asyncio.run(scenario())
    assert not queued_chunks[1:]  # at most the response headers' first line, never a token
    [queued] = read_usage(one_slot, "demo", set(queued_ids))
    assert queued.status == "cancelled"
    assert queued.usage.completion_tokens == 0
    [held] = [e for e in read_usage(one_slot, "demo", set(running_ids)) if e.billed_to == "tenant"]
    assert held.status == "cancelled" and 0 < held.usage.completion_tokens < 30000
