"""Whether a usage event is its reporter's to report: a worker speaks only for its own work.

A usage event's subject names who reported it (`inferbus.usage.<tenant>.<w | o>.<sender>`), and
NATS permissions let each identity publish only as itself (with per-pod identities; role-wide
ones, as itself or any replica of its role). A worker's report is taken only when the event names
that worker too and, where the `claims` bucket says which worker holds the attempt, that worker:
worker-2 cannot bill a request worker-1 runs, under its own name or under worker-1's.

Claims are the workers' own records; what a worker cannot write is the `dispatches` bucket, where
the gateway (or batch service) that queued a request put for which tenant (`inferbus.stores.dispatch_records`).
A worker's report billed to a tenant is taken only when the request's dispatch record names that
tenant: a request id the worker made up (no record), or a real request billed to another tenant,
is refused. Records age out (`bus.DISPATCH_TTL_S`): a report stored longer ago than
`bus.DISPATCH_JUDGED_S` (billing far behind, a replay) is judged without them. One whose record
cannot be read (NATS away) waits until it can be: billing stops meanwhile, rather than take a
report on its names alone.

`refusal` is the decision, pure; `Holders` reads the claims and dispatch records (the shell).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.bus import security_events
from inferbus.runtime import logs
from inferbus.runtime.records import decode_or_none
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

FOREIGN_USAGE = "foreign_usage"  # the security event's kind
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 5.0  # pauses between reads of dispatch records NATS did not answer
_dispatch_decoder = m.decoder(m.Dispatch)


class _NotJudged:
    """No dispatch record to judge by: not looked up (a replay, an old report) or unreadable."""

    def __repr__(self) -> str:
        return "NOT_JUDGED"


NOT_JUDGED = _NotJudged()
Dispatched = m.Dispatch | None | _NotJudged  # the record; None: there is none


def refusal(sender: tuple[str, str] | None, event: m.UsageEvent, holder: str | None,
            dispatched: Dispatched = NOT_JUDGED) -> str | None:
    """Why `event`, published on a subject naming `sender` while the attempt's claim names `holder`
    (None: no claim known) and the request's dispatch record is `dispatched`, is refused; None
    when it is accepted."""
    if sender is None or sender[0] != subjects.USAGE_FROM_WORKER:
        # The request's owner (its gateway) reports what no worker finished; an event without a
        # sender was written before senders were named (the ledger keeps them).
        return None
    worker = sender[1]
    if not event.worker_id or subjects.token(event.worker_id) != worker:
        return "names_another_worker"
    if holder is not None and subjects.token(subjects.claim_holder_worker(holder)) != worker:
        return "attempt_held_by_another"
    if event.billed_to == "tenant" and not isinstance(dispatched, _NotJudged):
        # (An abandoned attempt's work is the platform's cost: no tenant pays for it.)
        if dispatched is None:
            return "not_dispatched"
        if dispatched.request_id != event.request_id or dispatched.tenant != event.tenant:
            return "dispatched_for_another_tenant"
    return None


def judged(stored_at: float | None, now: float) -> bool:
    """Whether a report stored at `stored_at` (None: not known) is judged by its dispatch record,
    which exists for DISPATCH_JUDGED_S at least after the report was stored."""
    return stored_at is None or now - stored_at <= bus.DISPATCH_JUDGED_S


class Holders:
    """The holder of each attempt, from the `claims` bucket (workers create it; billing reads it).
    An attempt without a claim (aged out, the bucket missing, NATS away) has no known holder:
    the event is judged by its names alone."""

    def __init__(self, js: JetStreamContext, clock: Callable[[], float] = time.time) -> None:
        self._js = js
        self._kv: KeyValue | None = None
        self._dispatches: KeyValue | None = None
        self.clock = clock

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

    async def dispatch(self, request_id: str) -> Dispatched:
        """The request's dispatch record; None when there is none (the bucket missing: no
        request was ever dispatched)."""
        if self._dispatches is None:
            try:
                self._dispatches = await self._js.key_value(subjects.DISPATCHES_BUCKET)
            except BucketNotFoundError:
                return None
        try:
            entry = await self._dispatches.get(subjects.dispatch_key(request_id))
        except KeyNotFoundError:
            return None
        return decode_or_none(_dispatch_decoder, entry.value or b"", store="dispatches", key=request_id)

    async def dispatches(self, request_ids: Sequence[str],
                         waiting: Callable[[], Awaitable[None]] | None = None) -> list[Dispatched]:
        """The dispatch records of `request_ids`, looked up together. One that cannot be read (NATS
        away) is read again after a growing pause, however long it takes, and `waiting` is called
        at each pause (to keep the reports from being redelivered meanwhile): a report is never
        judged by its names alone because the bus was away, where a forger could slip one through."""
        found: list[Dispatched | None] = [None] * len(request_ids)
        unread = list(range(len(request_ids)))
        delay = RETRY_FIRST_S
        while True:
            results = await asyncio.gather(*(self.dispatch(request_ids[i]) for i in unread), return_exceptions=True)
            errors = {repr(r) for r in results if isinstance(r, BaseException)}
            for i, result in zip(unread, results):
                if not isinstance(result, BaseException):
                    found[i] = result
            unread = [i for i, r in zip(unread, results) if isinstance(r, BaseException)]
            if not unread:
                return found
            log.warning("dispatches_unreadable", error=sorted(errors), reports=len(unread), retry_in_s=delay)
            if waiting is not None:
                await waiting()
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    async def of(self, attempts: Sequence[tuple[str, int]]) -> list[str | None]:
        """The holders of `attempts`, looked up together."""
        try:
            found = await asyncio.gather(*(self.one(r, a) for r, a in attempts), return_exceptions=True)
        except Exception as error:  # the bucket's info failed: no holder known this time
            log.warning("claims_unreadable", error=repr(error))
            return [None] * len(attempts)
        return [h if isinstance(h, str) else None for h in found]


async def attributed(events: list[m.UsageEvent], senders: list[tuple[str, str] | None], holders: Holders | None,
                     *, record: bool, stored_at: Sequence[float | None] | None = None,
                     waiting: Callable[[], Awaitable[None]] | None = None) -> list[m.UsageEvent]:
    """The events (published on subjects naming `senders`, stored in the ledger at `stored_at`)
    their reporters may report; each other one is a security event when `record` (the rollup
    records them, the reconciler drops them too). Without `holders` (a replay) each is judged by
    its names alone. `waiting`: see `Holders.dispatches`."""
    by_worker = [
        i for i, sender in enumerate(senders) if sender is not None and sender[0] == subjects.USAGE_FROM_WORKER
    ]
    if not by_worker:
        return events
    known: list[str | None] = [None] * len(events)
    records: list[Dispatched] = [NOT_JUDGED] * len(events)
    if holders is not None:
        found = await holders.of([(events[i].request_id, events[i].attempt) for i in by_worker])
        for i, holder in zip(by_worker, found):
            known[i] = holder
        now = holders.clock()
        to_judge = [i for i in by_worker if events[i].billed_to == "tenant"
                    and judged(stored_at[i] if stored_at is not None else None, now)]
        records_found = await holders.dispatches([events[i].request_id for i in to_judge], waiting)
        for i, dispatched in zip(to_judge, records_found):
            records[i] = dispatched
    kept: list[m.UsageEvent] = []
    for event, sender, holder, dispatched in zip(events, senders, known, records):
        why = refusal(sender, event, holder, dispatched)
        if why is None:
            kept.append(event)
        elif record:
            security_events.record(FOREIGN_USAGE, why=why, request_id=event.request_id, attempt=event.attempt,
                                   tenant=event.tenant, reporter=sender[1] if sender else "",
                                   worker_named=event.worker_id, holder=holder,
                                   dispatched_for=dispatched.tenant if isinstance(dispatched, m.Dispatch) else None)
    return kept
