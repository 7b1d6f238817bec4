"""Request/reply over one inbox subscription per process, for the hot path.

nats-py's `request` (and so `js.publish`) draws a random reply token from the OS and wraps the
wait in `asyncio.wait_for` on every call; on the gateway's hot path that was a measurable share
of the CPU per request. Here replies land on `<inbox>.<counter>` and resolve a future; a timer
handle enforces the timeout.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError


class PublishError(Exception):
    """JetStream refused a publish (no stream for the subject, storage full, ...)."""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)

# JetStream's error code for a message id whose first publish the stream has not yet stored
# (nats-server's JSStreamDuplicateMessageConflict).
DUPLICATE_IN_PROCESS = 10158
# Errors of a cluster between leaders, which the same publish gets past a moment later
# (nats-server's JSClusterNotAvailErr, "JetStream system temporarily unavailable", and
# JSClusterNotLeaderErr; server/jetstream_errors_generated.go).
RETRYABLE = frozenset({DUPLICATE_IN_PROCESS, 10008, 10009})
# A publish's acknowledgement normally takes milliseconds; one not back within this long (the
# stream's leader died with the request, say) is asked again, under the same message id.
ACK_WAIT_S = 1.0


# Bytes kept free for a message's headers (message id, trace context) under the server's max_payload.
HEADER_ROOM = 4096


class Replies:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox() + "."
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._counter = itertools.count()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_reply, pending_msgs_limit=1_000_000)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_reply(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject[len(self._prefix):], None)
        if future is not None and not future.done():
            future.set_result(msg)

    @property
    def max_payload(self) -> int:
        """Largest message body the server takes, less room for the headers it also counts."""
        return int(self._nc.max_payload) - HEADER_ROOM

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None) -> Msg:
        """Like `nc.request`: NoRespondersError at once if nobody listens, TimeoutError after `timeout`."""
        token = str(next(self._counter))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            msg = await future
        finally:
            timer.cancel()
            self._pending.pop(token, None)
        if msg.headers and msg.headers.get("Status") == "503":
            raise NoRespondersError
        return msg

    async def publish_durable(self, subject: str, data: bytes, msg_id: str, timeout: float = 5.0,
                              headers: dict[str, str] | None = None) -> bool:
        """JetStream publish deduplicated by `msg_id`; True if stored now, False if it was a duplicate.

        Within `timeout` it is tried again where a cluster between leaders fails it (seconds after
        a stream's leader's node is lost): no responders, no acknowledgement within `ACK_WAIT_S`
        (the request or its reply lost with the node), or a transient cluster error. The
        message id makes a repeated publish safe."""
        all_headers = {"Nats-Msg-Id": msg_id, **(headers or {})}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.05
        while True:
            left = deadline - loop.time()
            try:
                reply = await self.request(subject, data, max(0.05, min(left, ACK_WAIT_S)), all_headers)
            except NoRespondersError:
                if left <= delay:
                    raise PublishError(f"no JetStream stream captures {subject}") from None
                await asyncio.sleep(delay)
                delay = min(0.5, delay * 2)
                continue
            except NatsTimeoutError:
                if deadline - loop.time() <= 0.05:
                    raise
                continue
            ack = _ack_decoder.decode(reply.data)
            if not ack.error:
                return not ack.duplicate
            description = str(ack.error.get("description", ack.error))
            # An earlier copy (a retry after a timeout) still going through the stream's consensus,
            # or a stream between leaders: asking again later gets the acknowledgement, or
            # "duplicate".
            if ack.error.get("err_code") not in RETRYABLE or left <= delay:
                raise PublishError(description)
            await asyncio.sleep(delay)
            delay = min(0.5, delay * 2)


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(NatsTimeoutError())
