"""Roll the usage ledger (the `USAGE` stream) up into per-tenant usage and cost counters in Redis.

One durable pull consumer, `usage-rollup`, with `DeliverPolicy.ALL`: shared by every billing
replica, and deleting it (see `rebuild`) replays the ledger from its first event. A batch (up to
`batch` events; two pull requests' worth are kept coming) is decoded (msgspec), priced with the
price book in force when each request was accepted, written with one Lua call per tenant in one
Redis round trip (`UsageStore.ingest`: dedup and counters in the same atomic call), and only then
acknowledged, each message explicitly.

Why that is exactly once:
- a crash after the Redis call and before the ack redelivers the batch: the dedup sets say every
  event was counted, nothing is added twice;
- a crash before the Redis call redelivers it too, and nothing had been added;
- a request id published twice (two stream sequences: a retry after JetStream's duplicate window,
  a gateway and a worker both reporting, or reports by several workers, since each report's
  message id carries a nonce of its reporter: `m.usage_publish_id`) is counted the first time it
  is taken only, since the dedup set is keyed by request id (`m.usage_msg_id`); a refused report
  never reaches it, so it cannot take the key from the holder's report;
- replicas pulling from one consumer see different messages; if they ever race on one (a
  redelivery after `ack_wait`), the script runs one at a time in Redis and only the first counts.
Acks are explicit, not `AckPolicy.ALL`: with several replicas, an "ack all" by one replica
would also acknowledge events another replica has not written yet, and a crash of that replica
would lose them.

Messages travel on a connection of their own (`pull.PullConnection`), not through nats-py, which
cost ~19 µs of CPU per message against ~4 µs (see bench/README.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, NotFoundError

from inferbus.runtime import logs
from inferbus.stores import usage as u
from inferbus.stores.billing import PriceStore, UsageStore
from proto import messages as m
from proto import subjects

from . import attribution, metrics
from .attribution import Holders
from .pull import Delivery, PullConnection, num_pending, stored_at

log = logs.get(__name__)
ROLLUP_CONSUMER = "usage-rollup"
_usage_decoder = msgspec.msgpack.Decoder(m.UsageEvent)


def consumer_config(ack_wait_s: float = 30.0) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=ROLLUP_CONSUMER, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s, max_ack_pending=50_000, filter_subject=subjects.usage_stream_subjects()[0],
    )


async def ensure_consumer(nc: Client, ack_wait_s: float = 30.0) -> None:
    """Create the consumer if it is missing (the first creator's settings stay)."""
    try:
        await nc.jetstream().add_consumer(subjects.USAGE_STREAM, consumer_config(ack_wait_s))
    except BadRequestError as error:
        if error.err_code != 10148:  # exists with another config: keep using it
            raise


class RollupConsumer:
    """`nc` (nats-py) creates and inspects the consumer; messages come over their own connection to
    `nats_url`."""

    def __init__(self, nc: Client, nats_url: str, store: UsageStore, prices: PriceStore, *, batch: int = 2000,
                 expires_s: float = 1.0, count_metrics: bool = True, concurrency: int = 2,
                 ack_wait_s: float = 30.0, linger_s: float = 0.005, holders: Holders | None = None) -> None:
        self.nc = nc
        self.linger_s = linger_s  # how long a batch gathers after its first event (see `next_batch`)
        self.store = store
        self.prices = prices
        self.batch = batch
        self.expires_s = expires_s
        self.count_metrics = count_metrics
        self.concurrency = concurrency
        self.ack_wait_s = ack_wait_s
        self.counted = 0
        self.duplicates = 0
        self.invalid = 0
        self.refused = 0  # usage events refused as another worker's (`attribution.refusal`)
        self.holders = holders  # who holds each attempt (None: events are judged by their names alone)
        self.on_batch: Callable[[int], None] | None = None  # called with each batch's size once written
        self.connection = PullConnection(nats_url, subjects.USAGE_STREAM, ROLLUP_CONSUMER, name="billing-rollup")
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.open()
        self._task = asyncio.create_task(self.run(), name="usage-rollup")

    async def open(self) -> None:
        await ensure_consumer(self.nc, self.ack_wait_s)
        await self.connection.connect()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.connection.close()

    async def run(self, done: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Roll up batches, up to `concurrency` at a time (one's Redis call overlaps the next one's
        decoding and pricing); forever, or until `done()` is true once the ledger looks drained."""
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()

        async def one(deliveries: list[Delivery]) -> None:
            try:
                await self.process(deliveries)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad batch end the rollup; its events are redelivered
                log.exception("rollup_batch_failed", events=len(deliveries))
                await asyncio.sleep(0.5)
            finally:
                slots.release()

        drained = False  # the ledger looked drained: poll briefly instead of long-polling
        try:
            while True:
                try:
                    deliveries = await self.next_batch(self.linger_s, wait_s=0.1 if drained else None)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("rollup_pull_failed")
                    await asyncio.sleep(0.5)
                    continue
                if deliveries:
                    await slots.acquire()
                    task = asyncio.create_task(one(deliveries))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if done is None or num_pending(deliveries[-1].reply) != 0:
                        drained = False
                        continue
                if done is not None:
                    drained = True
                    if tasks:
                        await asyncio.gather(*tasks)
                    if await done():
                        return
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    # ---- pulling --------------------------------------------------------------------------------

    async def _pull(self) -> None:
        c = self.connection
        if c.consumer_missing:  # deleted (a rebuild): recreate it, it replays the ledger
            c.consumer_missing = False
            await ensure_consumer(self.nc, self.ack_wait_s)
        if c.outstanding and time.monotonic() - c.last_activity > self.expires_s + 5.0:
            c.outstanding = 0  # the server lost our pull requests (a restart): ask again
        if c.outstanding <= self.batch:
            # Keep the next batch coming while this one is written.
            await c.pull(2 * self.batch - c.outstanding, self.expires_s)

    async def next_batch(self, linger_s: float = 0.005, wait_s: float | None = None) -> list[Delivery]:
        """Up to `batch` deliveries: waits up to `wait_s` (about `expires_s`) for the first one, then
        up to `linger_s` more while the rest of a batch is on its way, or more events come (small
        batches cost more per event: a Redis round trip, an ack write and wake-ups each)."""
        await self._pull()
        c = self.connection
        deadline = time.monotonic() + (self.expires_s + 0.5 if wait_s is None else wait_s)
        lingering = False
        while len(c.buffer) < self.batch:
            now = time.monotonic()
            if c.buffer and not lingering:
                if c.outstanding == 0:
                    break
                lingering, deadline = True, now + linger_s
            remaining = deadline - now
            if remaining <= 0:
                break
            c.wake.clear()
            try:
                await asyncio.wait_for(c.wake.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            if lingering and c.outstanding == 0:
                break
        deliveries, c.buffer = c.buffer[:self.batch], c.buffer[self.batch:]
        return deliveries

    # ---- rolling up ------------------------------------------------------------------------------

    async def process(self, deliveries: list[Delivery]) -> None:
        started = time.perf_counter()
        events: list[m.UsageEvent] = []
        senders: list[tuple[str, str] | None] = []
        stored: list[float | None] = []
        for delivery in deliveries:
            try:
                events.append(_usage_decoder.decode(delivery.data))
                senders.append(subjects.usage_sender(delivery.subject.decode(errors="replace")))
                stored.append(stored_at(delivery.reply))
            except msgspec.DecodeError:
                log.error("bad_usage_event", reply=delivery.reply.decode(errors="replace"))
                self.invalid += 1
                if self.count_metrics:
                    metrics.EVENTS.labels("invalid").inc()
        # Usage a worker reported for another's work is refused (a security event), never counted.
        async def waiting() -> None:  # the dispatch records unreadable: keep the reports meanwhile
            try:
                await self.connection.ack(deliveries, b"+WPI")
            except ConnectionError:
                pass

        kept = await attribution.attributed(events, senders, self.holders, record=True, stored_at=stored,
                                            waiting=waiting)
        self.refused += len(events) - len(kept)
        events = kept
        counted: list[bool] = []
        contributions: list[u.Contribution] = []
        delay = 0.5
        while True:
            try:
                # The epoch is read after the messages arrived: see `rebuild` for why that matters.
                epoch, price_version, _ = await self.store.state.snapshot()
                book = await self.prices.book(price_version)
                contributions = [u.contribution(event, book) for event in events]
                counted = await self.store.ingest(contributions, epoch)
                break
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis away: keep the batch (nothing acked), say so, try again
                log.warning("rollup_ingest_failed", events=len(events), error=repr(error))
                try:
                    await self.connection.ack(deliveries, b"+WPI")  # still working on them
                except ConnectionError:
                    pass
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
        await self.connection.ack(deliveries)
        self._account(deliveries, events, contributions, counted, started)

    def _account(self, deliveries: list[Delivery], events: list[m.UsageEvent], contributions: list[u.Contribution],
                 counted: list[bool], started: float) -> None:
        new = sum(counted)
        self.counted += new
        self.duplicates += len(counted) - new
        if self.on_batch is not None:
            self.on_batch(len(deliveries))
        if not self.count_metrics:
            return
        tokens: dict[tuple[str, str], list[int]] = {}
        for c, is_new in zip(contributions, counted):
            if is_new:
                key = (c.tenant, c.model)
                t = tokens.get(key)
                if t is None:
                    t = tokens[key] = [0, 0, 0, 0]
                row = c.row
                t[0] += row[4]
                t[1] += row[5]
                t[2] += row[6]
                t[3] += row[7] + row[8] + row[9]
        for (tenant, model), (prompt, cached, output, micro) in tokens.items():
            metrics.TOKENS.labels(tenant, model, "input").inc(prompt)
            metrics.TOKENS.labels(tenant, model, "cached_input").inc(cached)
            metrics.TOKENS.labels(tenant, model, "output").inc(output)
            metrics.DOLLARS.labels(tenant, model).inc(micro / 1_000_000)
        metrics.EVENTS.labels("counted").inc(new)
        metrics.EVENTS.labels("duplicate").inc(len(counted) - new)
        metrics.BATCHES.inc()
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
        pending = num_pending(deliveries[-1].reply)
        if pending >= 0:
            metrics.PENDING.set(pending)
        if events:
            metrics.LAG.set(max(0.0, time.time() - max(e.finished for e in events)))

    async def caught_up(self, slack: int = 0) -> bool:
        """True when the consumer has at most `slack` events left to deliver and, with no slack,
        every delivery was acknowledged."""
        info = await self.nc.jetstream().consumer_info(subjects.USAGE_STREAM, ROLLUP_CONSUMER)
        if slack:
            return info.num_pending <= slack
        return info.num_pending == 0 and info.num_ack_pending == 0 and not self.connection.buffer


async def rebuild(nc: Client, nats_url: str, store: UsageStore, prices: PriceStore, *, batch: int = 2000,
                  ack_wait_s: float = 30.0, on_progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Recount every rollup from the whole ledger; returns (events this process counted, events in
    the ledger). Running billing replicas may count some of them: they share the consumer.

    1. Bump the epoch: from now on every writer (this one, running billing replicas) writes to a
       new, empty set of keys; readers switch to it at once (and see totals fill up).
    2. Delete and recreate the `usage-rollup` consumer: it delivers the ledger from its first event.
       A replica still writing a batch it pulled before this reads the epoch after pulling, so it
       writes it into the new epoch with its dedup marks, and the redelivery counts nothing twice.
    3. Roll up until the consumer is caught up.
    4. Delete the keys of every other epoch.
    """
    js = nc.jetstream()
    await store.state.mark_rebuilding(True)  # monthly exports wait: the totals are partial until the end

    async def keep_marked() -> None:
        while True:
            await asyncio.sleep(60)
            await store.state.mark_rebuilding(True)

    marker = asyncio.create_task(keep_marked())
    try:
        return await _rebuild(nc, js, nats_url, store, prices, batch=batch, ack_wait_s=ack_wait_s,
                              on_progress=on_progress)
    finally:
        marker.cancel()
        await store.state.mark_rebuilding(False)


async def _rebuild(nc: Client, js: Any, nats_url: str, store: UsageStore, prices: PriceStore, *, batch: int,
                   ack_wait_s: float, on_progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    epoch = await store.state.bump_epoch()
    try:
        await js.delete_consumer(subjects.USAGE_STREAM, ROLLUP_CONSUMER)
    except NotFoundError:
        pass
    total = (await js.stream_info(subjects.USAGE_STREAM)).state.messages
    # Events judged by their names alone: the claims of most replayed attempts aged out long ago,
    # and a lookup per event would make a replay of the whole ledger several times slower.
    consumer = RollupConsumer(nc, nats_url, store, prices, batch=batch, count_metrics=False, ack_wait_s=ack_wait_s)
    if on_progress is not None:
        seen = 0

        def progress(n: int) -> None:
            nonlocal seen
            seen += n
            on_progress(seen, total)

        consumer.on_batch = progress
    await consumer.open()
    try:
        await consumer.run(done=consumer.caught_up)
    finally:
        await consumer.stop()
    await store.delete_other_epochs(epoch)
    log.info("rollup_rebuilt", epoch=epoch, counted=consumer.counted, duplicates=consumer.duplicates)
    return consumer.counted, total
