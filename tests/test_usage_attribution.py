"""A worker speaks only for its own work in the ledger: billing refuses a usage event a worker
reports for an attempt another worker holds, or that names another worker than the one the
subject names (`services/billing/attribution.py`). On a real nats-server and Redis: forgeries
refused and counted as security events, controls counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import REGISTRY

from inferbus.bus import connection as bus
from inferbus.bus.outbox import Outbox
from inferbus.bus.replies import Replies
from inferbus.stores.billing import PriceStore, UsageStore
from inferbus.stores.pricing import Prices
from proto import messages as m
from proto import subjects
from services.billing import attribution
from services.billing.attribution import NOT_JUDGED, Dispatched, Holders, judged, refusal
from services.billing.pull import stored_at
from services.billing.rollup import RollupConsumer
from services.worker.usage import UsageReporter

from .test_billing_store import totals

W, O = subjects.USAGE_FROM_WORKER, subjects.USAGE_FROM_OWNER
PRICES = Prices(1.0, 2.0, 0.5, 0.5)


def event(request_id: str, worker_id: str, tokens: int = 10, attempt: int = 0) -> m.UsageEvent:
    now = time.time()
    return m.UsageEvent(request_id=request_id, tenant="acme", model="m", status="completed",
                        usage=m.Usage(prompt_tokens=5, completion_tokens=tokens), started=now, finished=now,
                        worker_id=worker_id, attempt=attempt)


@pytest.mark.parametrize(("sender", "named", "holder", "why"), [
    ((W, "worker-1"), "worker-1", "worker-1@17.0", None),  # its own attempt
    ((W, "worker-1"), "worker-1", None, None),  # no claim known: judged by its names
    ((W, "worker-2"), "worker-2", "worker-1@17.0", "attempt_held_by_another"),
    ((W, "worker-2"), "worker-1", "worker-1@17.0", "names_another_worker"),
    ((W, "worker-2"), "worker-1", None, "names_another_worker"),
    ((W, "worker-2"), "", None, "names_another_worker"),
    ((O, "gateway-a"), "worker-1", "worker-1@17.0", None),  # the owner reports what no worker finished
    ((O, "gateway-a"), "", None, None),
    (None, "worker-9", "worker-1@17.0", None),  # written before senders were named
])
def test_refusal(sender: tuple[str, str] | None, named: str, holder: str | None, why: str | None) -> None:
    assert refusal(sender, event("r", named), holder) == why


def dispatch(request_id: str, tenant: str = "acme") -> m.Dispatch:
    return m.Dispatch(request_id=request_id, tenant=tenant, reply_to="inferbus.tok.gateway-a", created=0.0)


@pytest.mark.parametrize(("sender", "billed_to", "dispatched", "why"), [
    ((W, "worker-1"), "tenant", dispatch("r"), None),  # dispatched for the tenant it bills
    ((W, "worker-1"), "tenant", None, "not_dispatched"),  # a request id nobody dispatched
    ((W, "worker-1"), "tenant", dispatch("r", tenant="globex"), "dispatched_for_another_tenant"),
    ((W, "worker-1"), "tenant", dispatch("other-request"), "dispatched_for_another_tenant"),
    ((W, "worker-1"), "tenant", NOT_JUDGED, None),  # no record to judge by (old report, unreadable)
    ((W, "worker-1"), "platform", None, None),  # an abandoned attempt: nobody's bill
    ((O, "gateway-a"), "tenant", None, None),  # the owner's own report
])
def test_refusal_by_dispatch_record(sender: tuple[str, str], billed_to: str, dispatched: Dispatched,
                                    why: str | None) -> None:
    e = msgspec.structs.replace(event("r", "worker-1"), billed_to=billed_to)
    assert refusal(sender, e, "worker-1@17.0", dispatched) == why


def test_reports_are_judged_by_their_record_while_it_is_kept() -> None:
    now = 1_000_000.0
    assert judged(None, now) and judged(now - 60, now) and judged(now - bus.DISPATCH_JUDGED_S, now)
    assert not judged(now - bus.DISPATCH_JUDGED_S - 1, now)
    assert bus.DISPATCH_JUDGED_S + bus.REQUEST_LIFE_S == bus.DISPATCH_TTL_S


def test_stored_at_is_read_from_the_ack_subject() -> None:
    assert stored_at(b"$JS.ACK.USAGE.rollup.1.42.40.1765000000123456789.7") == pytest.approx(1765000000.123456789)
    assert stored_at(b"$JS.ACK.dom.hash.USAGE.rollup.1.42.40.1765000000000000000.7.rnd") == 1765000000.0
    assert stored_at(b"_INBOX.x.y") is None


def test_usage_subjects_name_their_sender() -> None:
    subject = subjects.usage_subject("acme.corp", W, "worker-1")
    assert subjects.usage_sender(subject) == (W, "worker-1")
    assert subjects.usage_sender("inferbus.usage.acme") is None
    assert subjects.attributed_usage_subject("inferbus.usage.acme", W, "worker-1") == "inferbus.usage.acme.w.worker-1"
    assert subjects.attributed_usage_subject(subject, O, "gw") == subject


def test_usage_message_ids_name_the_reporter_and_cannot_be_guessed() -> None:
    """Only the reporter's retries (which reuse its id) share a message id: another reporter, or
    another report of the same event, gets one nobody could compute in advance."""
    e = event("r", "worker-1")
    one = m.usage_publish_id(e, f"{W}.worker-1", m.new_usage_nonce())
    assert one.startswith(f"r.{W}.worker-1.") and len(one) == len(f"r.{W}.worker-1.") + 24
    assert one != m.usage_publish_id(e, f"{W}.worker-1", m.new_usage_nonce())
    abandoned = msgspec.structs.replace(e, billed_to="platform", attempt=2)
    assert m.usage_publish_id(abandoned, f"{W}.worker-1", "n") == f"r.2.abandoned.{W}.worker-1.n"


def foreign_usage() -> float:
    return REGISTRY.get_sample_value("inferbus_security_events_total", {"kind": "foreign_usage"}) or 0.0


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.mark.slow  # a nats-server and Redis of its own
async def test_billing_counts_only_the_holders_usage(nc: Client, redis: aioredis.Redis) -> None:
    """worker-1 holds attempt 0 of `held`; worker-2 reports usage for it under its own name, and
    again naming worker-1; worker-1 reports a request id it made up (and claimed) and a request
    dispatched for globex, billed to acme. All refused (a `foreign_usage` security event each);
    worker-1's own report of `held` (dispatched for acme) and a gateway's report of a request no
    worker finished are counted."""
    js = nc.jetstream()
    await bus.ensure_streams(js)
    claims = await bus.claims_bucket(js, 60)
    await claims.create(subjects.claim_key("held", 0), b"worker-1@17.0")
    # What the gateway put when it queued `held` (for acme) and `globex-request` (for globex).
    dispatches = await bus.dispatches_bucket(js)
    await dispatches.put(subjects.dispatch_key("held"), m.encode(dispatch("held")))
    await dispatches.put(subjects.dispatch_key("globex-request"), m.encode(dispatch("globex-request", "globex")))
    # worker-1 claims a request id nobody dispatched, as it may (claims are the workers' own).
    await claims.create(subjects.claim_key("invented", 0), b"worker-1@17.0")
    published = [
        (subjects.usage_subject("acme", W, "worker-2"), event("held", "worker-2", tokens=1000)),  # forged
        (subjects.usage_subject("acme", W, "worker-2"), event("held", "worker-1", tokens=1000)),  # forged
        (subjects.usage_subject("acme", W, "worker-1"), event("invented", "worker-1", tokens=1000)),  # forged
        (subjects.usage_subject("acme", W, "worker-1"), event("globex-request", "worker-1", tokens=1000)),  # forged
        (subjects.usage_subject("acme", W, "worker-1"), event("held", "worker-1", tokens=10)),  # control
        (subjects.usage_subject("acme", O, "gateway-a"), event("failed", "worker-1", tokens=3)),  # control
    ]
    for i, (subject, e) in enumerate(published):
        await js.publish(subject, m.encode(e), headers={"Nats-Msg-Id": f"m{i}"})
    store = UsageStore(redis)
    server = nc.connected_url
    assert server is not None
    consumer = RollupConsumer(nc, f"nats://{server.hostname}:{server.port}", store, PriceStore(redis, default=PRICES),
                              batch=10, count_metrics=False, holders=Holders(js))
    before = foreign_usage()
    await consumer.open()
    try:
        await asyncio.wait_for(
            consumer.run(done=lambda: asyncio.sleep(0, consumer.counted + consumer.refused >= 6)), 20
        )
    finally:
        await consumer.stop()
    assert (consumer.counted, consumer.refused) == (2, 4)
    assert foreign_usage() == before + 4
    # The ledger's dedup did not take the forged events either: the holder's own report counted.
    now = time.time()
    counted = await totals(store, ["acme"], now - 3600, now + 60)
    assert (counted.requests, counted.output_tokens) == (2, 13)


@pytest.mark.slow  # a nats-server and Redis of its own
async def test_a_forged_early_report_cannot_suppress_the_holders(nc: Client, redis: aioredis.Redis,
                                                                   tmp_path: Path) -> None:
    """worker-2 knows the id of a request worker-1 holds and reports usage for it first, under
    every message id it can compute (the request id, and the id naming worker-1 as reporter).
    JetStream still stores worker-1's report, published the way a worker publishes it (its
    outbox, `UsageReporter`), and billing counts it once; the forgeries are refused. Control:
    worker-1's retry of its own report (its acknowledgement lost) is dropped by JetStream and
    counted once."""
    js = nc.jetstream()
    await bus.ensure_streams(js)
    claims = await bus.claims_bucket(js, 60)
    await claims.create(subjects.claim_key("held", 0), b"worker-1@17.0")
    dispatches = await bus.dispatches_bucket(js)
    await dispatches.put(subjects.dispatch_key("held"), m.encode(dispatch("held")))
    forged_on = subjects.usage_subject("acme", W, "worker-2")
    for forged, msg_id in ((event("held", "worker-2", tokens=1000), "held"),
                           (event("held", "worker-1", tokens=1000), f"held.{W}.worker-1")):
        await js.publish(forged_on, m.encode(forged), headers={"Nats-Msg-Id": msg_id})
    replies = Replies(nc)
    await replies.start()
    stored: list[bool] = []  # per publish of worker-1's report: stored (True) or dropped as a duplicate

    async def publish_twice(subject: str, data: bytes, msg_id: str) -> None:
        stored.append(await replies.publish_durable(subject, data, msg_id))
        stored.append(await replies.publish_durable(subject, data, msg_id))  # the retry of a lost ack

    outbox = Outbox(tmp_path / "usage-outbox.sqlite3", publish_twice)
    await outbox.start()
    reporter = UsageReporter(outbox, "worker-1")
    now = time.time()
    request = m.InferenceRequest(
        request_id="held",
        tenant="acme",
        model="m",
        prompt="hi",
        sampling=m.SamplingParams(max_new_tokens=16),
        reply_to="inferbus.tok.gateway-a",
        deadline=now + 60,
        created=now,
    )
    try:
        await reporter.publish(request, "completed", m.Usage(prompt_tokens=5, completion_tokens=10), "stop")
        assert await outbox.drained(timeout=10)
    finally:
        await outbox.stop()
        await replies.stop()
    assert stored == [True, False]
    store = UsageStore(redis)
    server = nc.connected_url
    assert server is not None
    consumer = RollupConsumer(nc, f"nats://{server.hostname}:{server.port}", store, PriceStore(redis, default=PRICES),
                              batch=10, count_metrics=False, holders=Holders(js))
    await consumer.open()
    try:
        await asyncio.wait_for(consumer.run(done=consumer.caught_up), 20)
    finally:
        await consumer.stop()
    assert (consumer.counted, consumer.refused) == (1, 2)
    counted = await totals(store, ["acme"], now - 3600, now + 60)
    assert (counted.requests, counted.input_tokens, counted.output_tokens) == (1, 5, 10)


class Unreachable(Holders):
    """The claims and records of the bus, whose first `failures` reads of a dispatch record fail
    as they do while NATS is away."""

    def __init__(self, js: JetStreamContext, failures: int) -> None:
        super().__init__(js)
        self.failures = failures

    async def dispatch(self, request_id: str) -> Dispatched:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("nats: connection closed")
        return await super().dispatch(request_id)


@pytest.mark.slow  # a nats-server and Redis of its own
async def test_a_report_whose_record_cannot_be_read_waits_for_it(nc: Client, redis: aioredis.Redis,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """worker-1 reports a request id it made up (and claimed) while the dispatch records cannot be
    read: the rollup reads them again until it can, then refuses the report; it never takes it on
    its names alone. Control: the holder's report of a dispatched request is counted."""
    monkeypatch.setattr(attribution, "RETRY_FIRST_S", 0.05)
    js = nc.jetstream()
    await bus.ensure_streams(js)
    claims = await bus.claims_bucket(js, 60)
    dispatches = await bus.dispatches_bucket(js)
    await dispatches.put(subjects.dispatch_key("held"), m.encode(dispatch("held")))
    for request_id in ("held", "invented"):
        await claims.create(subjects.claim_key(request_id, 0), b"worker-1@17.0")
    for i, request_id in enumerate(("invented", "held")):
        await js.publish(subjects.usage_subject("acme", W, "worker-1"), m.encode(event(request_id, "worker-1")),
                         headers={"Nats-Msg-Id": f"m{i}"})
    store = UsageStore(redis)
    server = nc.connected_url
    assert server is not None
    holders = Unreachable(js, failures=5)
    consumer = RollupConsumer(nc, f"nats://{server.hostname}:{server.port}", store, PriceStore(redis, default=PRICES),
                              batch=10, count_metrics=False, holders=holders)
    await consumer.open()
    try:
        await asyncio.wait_for(consumer.run(done=lambda: asyncio.sleep(0, consumer.counted + consumer.refused >= 2)),
                               20)
    finally:
        await consumer.stop()
    assert (consumer.counted, consumer.refused) == (1, 1)
    assert holders.failures == 0  # every failed read was read again
