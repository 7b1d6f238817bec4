"""Whether a usage event is its reporter's to report: a worker speaks only for its own work.

A usage event's subject names who reported it (`inferbus.usage.<tenant>.<w | o>.<sender>`), and
NATS permissions let each identity publish only as itself (with per-pod identities; role-wide
ones, as itself or any replica of its role). A worker's report is taken only when the event names
that worker too and, where the `claims` bucket says which worker holds the attempt, that worker:
worker-2 cannot bill a request worker-1 runs, under its own name or under worker-1's.

`refusal` is the decision, pure; `Holders` reads the claims (the shell).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from inferbus import logs, security_events
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

FOREIGN_USAGE = "foreign_usage"  # the security event's kind


def refusal(sender: tuple[str, str] | None, event: m.UsageEvent, holder: str | None) -> str | None:
    """Why `event`, published on a subject naming `sender` while the attempt's claim names `holder`
    (None: no claim known), is refused; None when it is accepted."""
    if sender is None or sender[0] != subjects.USAGE_FROM_WORKER:
        # The request's owner (its gateway) reports what no worker finished; an event without a
        # sender was written before senders were named (the ledger keeps them).
        return None
    worker = sender[1]
    if not event.worker_id or subjects.token(event.worker_id) != worker:
        return "names_another_worker"
    if holder is not None and subjects.token(subjects.claim_holder_worker(holder)) != worker:
        return "attempt_held_by_another"
    return None


class Holders:
    """The holder of each attempt, from the `claims` bucket (workers create it; billing reads it).
    An attempt without a claim (aged out, the bucket missing, NATS away) has no known holder:
    the event is judged by its names alone."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue | None:
        if self._kv is None:
            try:
                self._kv = await self._js.key_value(subjects.CLAIMS_BUCKET)
            except BucketNotFoundError:
                return None  # no worker created it yet: no attempt is claimed
        return self._kv

    async def one(self, request_id: str, attempt: int) -> str | None:
        kv = await self._bucket()
        if kv is None:
            return None
        try:
            entry = await kv.get(subjects.claim_key(request_id, attempt))
        except KeyNotFoundError:
            return None
        return (entry.value or b"").decode() or None

    async def of(self, attempts: Sequence[tuple[str, int]]) -> list[str | None]:
        """The holders of `attempts`, looked up together."""
        try:
            found = await asyncio.gather(*(self.one(r, a) for r, a in attempts), return_exceptions=True)
        except Exception as error:  # the bucket's info failed: no holder known this time
            log.warning("claims_unreadable", error=repr(error))
            return [None] * len(attempts)
        return [h if isinstance(h, str) else None for h in found]


async def attributed(events: list[m.UsageEvent], senders: list[tuple[str, str] | None], holders: Holders | None,
                     *, record: bool) -> list[m.UsageEvent]:
    """The events (published on subjects naming `senders`) their reporters may report; each other
    one is a security event when `record` (the rollup records them, the reconciler drops them too)."""
    by_worker = [i for i, sender in enumerate(senders) if sender is not None and sender[0] == subjects.USAGE_FROM_WORKER]
    if not by_worker:
        return events
    known: list[str | None] = [None] * len(events)
    if holders is not None:
        found = await holders.of([(events[i].request_id, events[i].attempt) for i in by_worker])
        for i, holder in zip(by_worker, found):
            known[i] = holder
    kept: list[m.UsageEvent] = []
    for event, sender, holder in zip(events, senders, known):
        why = refusal(sender, event, holder)
        if why is None:
            kept.append(event)
        elif record:
            security_events.record(FOREIGN_USAGE, why=why, request_id=event.request_id, attempt=event.attempt,
                                   tenant=event.tenant, reporter=sender[1] if sender else "",
                                   worker_named=event.worker_id, holder=holder)
    return kept
