"""A client of the OpenAI API over NATS, for internal producers (services already on the bus).

The calls go through the gateway's admission exactly as HTTP calls do (API key, tenant, quotas,
priority band, billing); bodies and answers are the OpenAI JSON shapes. Use it with a connected
`nats.aio.client.Client`:

    nc = await nats.connect("nats://127.0.0.1:4222")
    api = BusClient(nc, api_key="sk-...")
    answer = await api.chat_completion(model="...", messages=[{"role": "user", "content": "Hi"}])
    async for chunk in api.stream_chat_completion(model="...", messages=[...]):
        print(chunk["choices"][0]["delta"].get("content", ""), end="")

Errors are `BusAPIError` with the HTTP status the same call would have had (401 bad key, 429
quota, 503 overloaded, ...) and OpenAI's error object.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from proto import messages as m
from proto import subjects

Endpoint = Literal["chat", "completion"]


class BusAPIError(Exception):
    """An OpenAI-format error answered over the bus. `status` is the HTTP status the same call
    would have had; None for an error inside a stream (its status was already 200)."""

    def __init__(self, status: int | None, error: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{status}: {error.get('message')}")
        self.status = status
        self.error = error
        self.code = error.get("code")
        self.headers = headers or {}


def _no_gateway() -> BusAPIError:
    return BusAPIError(503, {"message": "No gateway serves the internal API on this bus.", "type": "server_error",
                             "param": None, "code": "no_gateway"})


def _timeout() -> BusAPIError:
    return BusAPIError(504, {"message": "No answer from the gateway in time.", "type": "timeout_error",
                             "param": None, "code": "timeout"})


class BusClient:
    def __init__(self, nc: NATS, api_key: str, timeout: float = 600.0) -> None:
        """`timeout`: seconds to wait for an answer (streamed: for each chunk)."""
        self.nc = nc
        self.api_key = api_key
        self.timeout = timeout

    async def chat_completion(self, **body: Any) -> dict[str, Any]:
        """`/v1/chat/completions`, not streamed: the `chat.completion` object."""
        return await self.create("chat", body)

    async def completion(self, **body: Any) -> dict[str, Any]:
        """`/v1/completions`, not streamed: the `text_completion` object."""
        return await self.create("completion", body)

    def stream_chat_completion(self, **body: Any) -> AsyncIterator[dict[str, Any]]:
        """`/v1/chat/completions` streamed: its `chat.completion.chunk` objects."""
        return self.stream("chat", body)

    def stream_completion(self, **body: Any) -> AsyncIterator[dict[str, Any]]:
        return self.stream("completion", body)

    async def create(self, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise ValueError("stream=True: use stream() or the stream_* methods")
        try:
            msg = await self.nc.request(subjects.api_subject(endpoint), msgspec.json.encode(body),
                                        timeout=self.timeout, headers=self._headers())
        except NoRespondersError:
            raise _no_gateway() from None
        except NatsTimeoutError:
            raise _timeout() from None
        status, answer = read_answer(msg)
        if status >= 400:
            raise BusAPIError(status, answer.get("error", {}), dict(msg.headers or {}))
        return answer

    async def stream(self, endpoint: Endpoint, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed call. Leaving the loop early abandons the call: the gateway
        cancels the request (billed for what was generated, like an HTTP client that hangs up)."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        cancel: str | None = None
        finished = False
        try:
            await self.nc.publish(subjects.api_subject(endpoint), msgspec.json.encode({**body, "stream": True}),
                                  reply=inbox, headers=self._headers())
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.timeout)
                except NatsTimeoutError:
                    raise _timeout() from None
                headers = msg.headers or {}
                if m.API_HEADER_STATUS not in headers:
                    finished = True
                    raise _no_gateway()  # the server's own "no responders" status message
                cancel = cancel or headers.get(m.API_HEADER_CANCEL)
                kind = headers.get(m.API_HEADER_STREAM)
                if kind is None:  # refused before streaming: one error reply
                    finished = True
                    status, answer = read_answer(msg)
                    raise BusAPIError(status, answer.get("error", {}), dict(headers))
                if kind == m.API_STREAM_DONE:
                    finished = True
                    return
                chunk = msgspec.json.decode(msg.data)
                if "error" in chunk:  # failed mid-stream
                    finished = True
                    raise BusAPIError(None, chunk["error"], dict(headers))
                yield chunk
        finally:
            await sub.unsubscribe()
            if not finished and cancel is not None and not self.nc.is_closed:
                await self.nc.publish(cancel, b"")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", m.API_HEADER_VERSION: m.API_VERSION}


def read_answer(msg: Msg) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of a gateway's (not streamed) reply."""
    headers = msg.headers or {}
    if m.API_HEADER_STATUS not in headers:
        raise _no_gateway()
    return int(headers[m.API_HEADER_STATUS]), msgspec.json.decode(msg.data)
