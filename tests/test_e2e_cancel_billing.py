"""A client that leaves mid-stream is billed what it received, counted on its side of the socket.

The client speaks HTTP itself so that it can count exactly what reached it: it half-closes the
connection (the gateway sees the disconnect and closes its side) and reads what was sent until
then. What it received is counted from its own bytes (one logprob entry per token), not from any
usage the platform reports; the ledger's tenant event must say the same, and the tokens the
engine made after the client left (before the abort reached it) are the platform's.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest

from proto import messages as m

from .conftest import MODEL, Platform, read_usage

pytestmark = pytest.mark.e2e


async def _read_chunked(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked HTTP body; None at its end or when the connection closed."""
    size_line = await reader.readline()
    if not size_line.strip():
        return None
    size = int(size_line.strip().split(b";")[0], 16)
    if size == 0:
        return None
    data = await reader.readexactly(size)
    await reader.readexactly(2)
    return data


async def _stream_and_leave(platform: Platform, leave_after: int) -> tuple[str, int, str]:
    """Stream a long answer, leave after `leave_after` tokens; (request id, tokens received, text)."""
    url = urlsplit(platform.stack.gateway_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write at length about rivers."}],
                       "max_tokens": 3000, "stream": True, "logprobs": True}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                 + f"authorization: Bearer {platform.api_key}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
    request_id = ""
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "x-request-id":
            request_id = value.strip()
    received, text, buffer, left = 0, [], b"", False
    while (chunk := await _read_chunked(reader)) is not None:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            payload = event.removeprefix(b"data: ")
            if payload == b"[DONE]":
                continue
            parsed = json.loads(payload)
            for choice in parsed.get("choices", []):
                received += len(((choice.get("logprobs") or {}).get("content")) or [])
                text.append((choice.get("delta") or {}).get("content") or "")
        if received >= leave_after and not left:
            writer.write_eof()  # leave; what the gateway sent before it noticed still arrives
            left = True
    writer.close()
    return request_id, received, "".join(text)


def test_a_client_gone_mid_stream_is_billed_what_it_received(platform: Platform) -> None:
    request_id, received, text = asyncio.run(_stream_and_leave(platform, leave_after=30))
    assert 30 <= received < 3000 and text
    events = read_usage(platform, "demo", {request_id})
    [billed] = [e for e in events if e.billed_to == "tenant"]
    assert billed.status == "cancelled"
    assert billed.usage.completion_tokens == received
    made = billed.usage.completion_tokens + sum(e.usage.completion_tokens for e in events if e.billed_to == "platform")
    assert made >= received  # anything made after the client left is the platform's cost
    assert all(e.status == "cancelled" for e in events if isinstance(e, m.UsageEvent))
