"""The OpenAI API for internal producers, over NATS request/reply (`inferbus.api.v1.*`).

A producer on the bus sends a `/v1/chat/completions` or `/v1/completions` JSON body to
`subjects.api_subject(endpoint)` with `Authorization: Bearer <tenant API key>` in its headers and a
reply inbox. Every gateway subscribes in one queue group, so one of them answers, and it answers
by running the call through `Generation` exactly as an HTTP request: the same key check, tenant,
quotas, priority band, fair queue, dispatch and billing. The call is handed to `Generation` as an
ASGI request whose response is published to the inbox instead of written to a socket:

Replies go only to the caller's inbox (`_INBOX.<identity>.…`, `inferbus.bus.reply_check`): a call
naming any other reply subject (a JetStream API subject, a KV key, a data subject) is refused
unanswered and counted as a security event.

- not streamed: one reply, the response body (or the OpenAI error) as JSON;
- streamed: one reply per server-sent event (each a chunk's JSON, the `data:` of the event), then
  an empty reply marked done. The first names a subject the producer may publish to to abandon
  the stream, which `Generation` sees as a client disconnect (the request is cancelled).

Every reply carries the status the HTTP call would have had and the request id (see the API_*
header names in proto/messages.py); `retry-after` and `x-ratelimit-*` headers are passed on.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter

from inferbus.bus.security_events import answerable
from inferbus.openai.errors import OpenAIError
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

API_CALLS = Counter("inferbus_api_bus_calls_total", "Internal producer calls over NATS, by endpoint and status",
                    ["endpoint", "status"])

# Headers of the producer's message handed to `Generation` (as an HTTP request's would be).
_FORWARDED = ("authorization", "traceparent", "tracestate")
# Headers of `Generation`'s response passed on to the producer.
_PASSED_ON = (b"retry-after", b"x-should-retry")
_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}

Handler = Callable[[dict[str, Any], Any, Any, str], Awaitable[None]]


def request_scope(endpoint: str, body: bytes, headers: dict[str, str] | None) -> dict[str, Any]:
    """The ASGI scope of an HTTP request equivalent to the producer's message."""
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    scope_headers = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    scope_headers += [(name.encode(), lowered[name].encode("latin-1", "replace")) for name in _FORWARDED
                      if name in lowered]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "nats",
            "path": _PATHS[endpoint], "raw_path": _PATHS[endpoint].encode(), "query_string": b"",
            "headers": scope_headers, "client": None, "server": None, "state": {}}


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events in `buffer` as their `data` payloads (`[DONE]` dropped), and
    the incomplete rest."""
    *frames, rest = buffer.split(b"\n\n")
    events = []
    for frame in frames:
        if frame.startswith(b"data: "):
            data = frame[len(b"data: "):]
            if data != b"[DONE]":
                events.append(data)
    return events, rest


class BusReply:
    """The ASGI `send` of one call: what `Generation` writes goes to the producer's inbox."""

    def __init__(self, publish: Callable[..., Awaitable[None]], reply_to: str, cancel_subject: str) -> None:
        self.publish = publish
        self.reply_to = reply_to
        self.cancel_subject = cancel_subject
        self.status = 500
        self.streaming = False
        self.headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._buffer = b""
        self._first = True

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            raw = dict(message.get("headers", []))
            self.streaming = raw.get(b"content-type", b"").startswith(b"text/event-stream")
            self.headers = {m.API_HEADER_VERSION: m.API_VERSION, m.API_HEADER_STATUS: str(self.status),
                            m.API_HEADER_REQUEST_ID: raw.get(b"x-request-id", b"").decode()}
            for name, value in message.get("headers", []):
                if name in _PASSED_ON or name.startswith(b"x-ratelimit-"):
                    self.headers[name.decode()] = value.decode("latin-1")
            return
        if message["type"] != "http.response.body":
            return
        more = message.get("more_body", False)
        if not self.streaming:
            self._body.append(message.get("body", b""))
            if not more:
                await self.publish(self.reply_to, b"".join(self._body), headers=self.headers)
            return
        events, self._buffer = split_events(self._buffer + message.get("body", b""))
        for data in events:
            await self.publish(self.reply_to, data, headers=self._chunk_headers(m.API_STREAM_CHUNK))
        if not more:
            await self.publish(self.reply_to, b"", headers=self._chunk_headers(m.API_STREAM_DONE))

    def _chunk_headers(self, kind: str) -> dict[str, str]:
        headers = {**self.headers, m.API_HEADER_STREAM: kind}
        if self._first:
            headers[m.API_HEADER_CANCEL] = self.cancel_subject
            self._first = False
        return headers


class InternalApi:
    """Subscribes the gateway to the internal producers' subjects and runs their calls."""

    def __init__(self, nc: NATS, handler: Handler, gateway_id: str) -> None:
        self.nc = nc
        self.handler = handler  # `Generation.__call__`
        self.gateway_id = gateway_id
        self._subs: list[Subscription] = []
        self._gone: dict[str, asyncio.Event] = {}  # call id → set when its producer abandons it
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(subjects.api_wildcard(), queue=subjects.API_QUEUE, cb=self._on_call),
            await self.nc.subscribe(subjects.api_cancel_wildcard(self.gateway_id), cb=self._on_cancel),
        ]

    async def stop(self) -> None:
        """Stop taking calls; calls in progress are abandoned as if their producers had left."""
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        for gone in self._gone.values():
            gone.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    async def _on_call(self, msg: Msg) -> None:
        task = asyncio.ensure_future(self.serve(msg))  # one call never waits for another
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_cancel(self, msg: Msg) -> None:
        call_id = msg.subject.rsplit(".", 1)[-1]
        gone = self._gone.get(call_id)
        if gone is not None:
            gone.set()

    async def serve(self, msg: Msg) -> None:
        endpoint = subjects.api_endpoint(msg.subject)
        if not msg.reply:
            log.warning("api_call_without_reply", subject=msg.subject)
            return
        if not answerable(msg):
            return  # a reply subject no producer owns: answering would publish there with our rights
        if endpoint is None:
            error = OpenAIError(404, f"Unknown subject: {msg.subject}", code="unknown_url")
            headers = {m.API_HEADER_VERSION: m.API_VERSION, m.API_HEADER_STATUS: "404"}
            await self.nc.publish(msg.reply, msgspec.json.encode(error.body()), headers=headers)
            API_CALLS.labels("unknown", "404").inc()
            return
        call_id = uuid.uuid4().hex
        gone = self._gone[call_id] = asyncio.Event()
        reply = BusReply(self.nc.publish, msg.reply, subjects.api_cancel_subject(self.gateway_id, call_id))
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": msg.data, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        try:
            await self.handler(request_scope(endpoint, msg.data, msg.headers), receive, reply.send, endpoint)
        except Exception:
            log.exception("api_call_failed", endpoint=endpoint)
        finally:
            del self._gone[call_id]
            API_CALLS.labels(endpoint, str(reply.status)).inc()
