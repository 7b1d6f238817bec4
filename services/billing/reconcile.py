"""Reconcile admission reservations with what requests really used, from the usage ledger.

Costs come from the versioned price book exactly as the rollups compute them
(`usage.contribution`), so the monthly spend budgets are checked against equals the month's
`/v1/costs` total.

Every request the platform accepted ends in exactly one event on the `USAGE` stream (completed,
cancelled or failed), so consuming the ledger reconciles every outcome, including requests whose
client went away and whose gateway never saw the final usage. One durable consumer is shared by
all billing replicas; `Admission.reconcile` is idempotent by request id, so a redelivery or a crash
between reconciling and acking never counts twice.
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError

from inferbus.runtime import logs
from inferbus.stores.admission import Admission
from inferbus.stores.billing import PriceStore
from inferbus.stores.usage import contribution
from proto import messages as m
from proto import subjects

from . import attribution
from .attribution import Holders
from .pull import stored_at

log = logs.get(__name__)
RECONCILER = "admission-reconciler"
# Leases are freed by the gateway at once; refunds and spend may lag this long. (nats-py's fetch
# with a much shorter timeout, 50 ms, never returned messages here.)
IDLE_WAIT_S = 1.0
_usage_decoder = msgspec.msgpack.Decoder(m.UsageEvent)


class UsageReconciler:
    def __init__(self, js: JetStreamContext, admission: Admission, prices: PriceStore, batch: int = 512,
                 linger_s: float = 0.0, holders: Holders | None = None) -> None:
        self.js = js
        self.holders = holders
        self.linger_s = linger_s  # after a batch smaller than `batch`, let events gather this long
        self.admission = admission
        self.prices = prices
        self.batch = batch
        self._task: asyncio.Task[None] | None = None
        self._subscription: JetStreamContext.PullSubscription | None = None

    async def start(self) -> None:
        # One durable pull consumer shared by every billing replica. Batches: what is there is taken at
        # once (a wait of up to IDLE_WAIT_S only when idle), reconciled in one Redis round trip and
        # acknowledged with one ack (AckPolicy.ALL).
        config = ConsumerConfig(
            durable_name=RECONCILER, deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.ALL, ack_wait=30,
            max_ack_pending=20_000, filter_subject=subjects.usage_stream_subjects()[0],
        )
        try:
            await self.js.add_consumer(subjects.USAGE_STREAM, config)
        except BadRequestError as error:
            if error.err_code != 10148:  # exists with another config: keep using it
                raise
        self._subscription = await self.js.pull_subscribe_bind(RECONCILER, subjects.USAGE_STREAM)
        self._task = asyncio.create_task(self._run(self._subscription), name="reconcile")

    async def stop(self) -> None:
        # Stop fetching before the connection drains: a pending pull would hold the drain up.
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    async def _run(self, subscription) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                messages = await subscription.fetch(self.batch, timeout=IDLE_WAIT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                continue  # nothing new
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a reconnect in progress, or worse: say so, then retry
                log.warning("usage_fetch_failed", error=repr(error))
                await asyncio.sleep(0.5)
                continue
            if not messages:  # nats-py may return an empty batch instead of timing out
                continue
            try:
                await self._reconcile(messages)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad batch end reconciliation for good
                log.exception("reconcile_batch_failed", events=len(messages))
                await asyncio.sleep(0.5)
            if len(messages) < self.batch and self.linger_s > 0:
                # Caught up: the next fetch takes what gathered meanwhile in one pull, one Redis
                # round trip and one ack, instead of an event at a time.
                await asyncio.sleep(self.linger_s)

    async def _reconcile(self, messages: list[Msg]) -> None:
        events: list[m.UsageEvent] = []
        senders: list[tuple[str, str] | None] = []
        stored: list[float | None] = []
        for msg in messages:
            try:
                events.append(_usage_decoder.decode(msg.data))
                senders.append(subjects.usage_sender(msg.subject))
                stored.append(stored_at(msg.reply.encode()))
            except msgspec.DecodeError:
                log.error("bad_usage_event", subject=msg.subject)
        # Another worker's report touches no tenant's quota either (the rollup records it).
        async def waiting() -> None:  # the dispatch records unreadable: keep the messages meanwhile
            for msg in messages:
                try:
                    await msg.in_progress()
                except Exception:  # NATS away: they are redelivered, and judged again
                    return

        events = await attribution.attributed(events, senders, self.holders, record=False, stored_at=stored,
                                              waiting=waiting)
        while True:
            try:
                # The cost the rollups bill (price book at the request's accept time, batch discount,
                # whole micro-dollars), so a month's budget spend equals its /v1/costs total.
                book = await self.prices.book()
                # Abandoned attempts are the platform's cost: they never touch a tenant's quota.
                usages = [(e.tenant, e.request_id, e.usage.prompt_tokens, e.usage.completion_tokens,
                           contribution(e, book).costs.total / 1_000_000) for e in events if e.billed_to == "tenant"]
                await self.admission.reconcile_many(usages)
                break
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis away: keep the batch and try again; nothing is acked yet
                log.warning("reconcile_failed", events=len(usages), error=repr(error))
                for msg in messages:
                    await msg.in_progress()
                await asyncio.sleep(1.0)
        await messages[-1].ack()  # AckPolicy.ALL: acknowledges the whole batch
