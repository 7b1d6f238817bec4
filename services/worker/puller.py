"""Pull consumers that hand each message over the moment it arrives.

nats-py's `fetch(batch=n)` returns only when the batch is full or its timeout passes, which
would hold a request's first message back for the whole long-poll. This is the "consume"
pattern instead: pull requests (`$JS.API.CONSUMER.MSG.NEXT`) reply into one inbox; messages are
dispatched on arrival; the server's 408/409 status replies say how many requested messages were
never sent, and those slots go back to the budget.

Each puller also knows how many requests wait on its consumer, as far as it can tell: every
message carries the consumer's pending count (in its ack subject), an expired request says the
queue ran dry, and the serving loop asks the server when it has no pull in flight
(`pull_plan` decides what to pull with it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus.runtime import logs

from .slots import SlotBudget

log = logs.get(__name__)

_PENDING = "Nats-Pending-Messages"


class Puller:
    """One durable pull consumer, drawing slots from a budget shared with the worker's other pullers."""

    def __init__(
        self,
        nc: Client,
        stream: str,
        consumer: str,
        budget: SlotBudget,
        on_message: Callable[[Msg], None],
        *,
        wake: asyncio.Event,
        expires_s: float = 1.0,
        room: Callable[[], int] | None = None,
        on_consumer_gone: Callable[[str], None] | None = None,
    ) -> None:
        self._nc = nc
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._budget = budget
        self._on_message = on_message
        self._wake = wake
        self._expires_s = expires_s
        # At most how many slots this consumer may reserve now (batch: what the preemption policy
        # grants); None: as many as the budget gives.
        self._room = room
        self.consumer = consumer
        # Told when the server says the consumer is gone (deleted, or no JetStream answers for
        # it): a router deletes the consumers of a worker it declared dead.
        self._on_consumer_gone = on_consumer_gone
        self.outstanding = 0  # slots reserved by pull requests not yet answered
        self.waiting = 0  # requests known to wait on the consumer (the last message's pending count)
        self._last_activity = time.monotonic()
        self._inbox = ""
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._handle, pending_msgs_limit=100_000)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        self._give_back(self.outstanding)

    def room(self) -> int:
        """At most how many slots this consumer may take now."""
        return self._budget.capacity if self._room is None else self._room()

    async def pull(self, slots: int | None = None, expires_s: float | None = None) -> bool:
        """Ask for `slots` messages (None: as many as the budget's fair share grants); False if
        no slot was granted.

        `expires_s` bounds how long the request may hold its slots waiting for messages.
        """
        if self._sub is None:
            return False
        self._reclaim_if_stale()
        if self.outstanding:
            return False  # one pull request in flight per consumer keeps accounting exact
        want = min(self.room(), slots) if slots is not None else self.room()
        if want <= 0:
            return False
        granted = self._budget.take(want) if slots is not None else self._budget.reserve(want)
        if granted == 0:
            return False
        self.outstanding = granted
        self._last_activity = time.monotonic()
        request = {"batch": granted, "expires": int((expires_s or self._expires_s) * 1e9)}
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)
        return True

    async def _handle(self, msg: Msg) -> None:
        self._last_activity = time.monotonic()
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None and msg.reply:
            self.waiting = pending_after(msg.reply)
            if self.outstanding:
                self.outstanding -= 1  # the slot moves from the pull to the running request
            else:
                self._budget.take_unreserved()
            self._on_message(msg)
            if self.outstanding == 0:
                self._wake.set()
            return
        if status == "100":  # idle heartbeat
            return
        # 404 no messages, 408 request expired, 409 consumer changed: the rest is not coming.
        description = str(headers.get("Description", "")).lower()
        gone = status == "503" or (status == "409" and "consumer deleted" in description)
        if gone and self._on_consumer_gone is not None:
            self._on_consumer_gone(f"consumer {self.consumer}: {status} {headers.get('Description', '')}".strip())
        pending = headers.get(_PENDING)
        unsent = int(pending) if pending is not None else self.outstanding
        if status in ("404", "408") and unsent > 0:
            self.waiting = 0  # the request ran out of time with slots unfilled: nothing waits
        self._give_back(min(unsent, self.outstanding))

    def _give_back(self, n: int) -> None:
        if n > 0:
            self.outstanding -= n
            self._budget.release(n)
        self._wake.set()

    def forget_pulls(self) -> None:
        """After a reconnect: the server may have lost our pull requests, so ask again."""
        self._give_back(self.outstanding)

    def _reclaim_if_stale(self) -> None:
        # A pull request whose expiry status never came (server restarted) must not pin slots forever.
        if self.outstanding and time.monotonic() - self._last_activity > self._expires_s + 5.0:
            log.warning("pull_request_lost", consumer=self.consumer, slots=self.outstanding)
            self._give_back(self.outstanding)


def pending_after(reply: str) -> int:
    """The consumer's pending count in a JetStream message's ack subject: how many messages
    wait behind this one (`$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`,
    or the longer form with a domain and account hash and a trailing token)."""
    tokens = reply.split(".")
    try:
        if len(tokens) == 9:
            return int(tokens[8])
        if len(tokens) >= 11:
            return int(tokens[10])
    except ValueError:
        pass
    return 0
