"""Billing's Redis records against a real Redis: idempotent ingest, buckets, epochs, the price book."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from inferbus.stores import usage as u
from inferbus.stores.billing import MAX_EVENTS_PER_CALL, MAX_EVENTS_PER_ROUND_TRIP, PriceStore, UsageStore
from inferbus.stores.pricing import PriceBook, Prices, PriceVersion
from proto import messages as m

pytestmark = pytest.mark.slow

DEFAULT = Prices(0.60, 0.90, 0.15, 0.5)
BOOK = PriceBook([], DEFAULT)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


def events(tenant: str, n: int, started: float, spread_s: float = 0.0) -> list[m.UsageEvent]:
    return [m.UsageEvent(request_id=uuid.uuid4().hex, tenant=tenant, model="m", status="completed",
                         usage=m.Usage(prompt_tokens=10 + i % 50, completion_tokens=i % 30, cached_tokens=i % 7),
                         started=started + i * spread_s / max(1, n), finished=started + 1, api_key_id=f"k{i % 2}")
            for i in range(n)]


async def totals(store: UsageStore, tenants: list[str], start: float, end: float, width: str = "1d",
                 epoch: int | None = None) -> u.Totals:
    query = u.UsageQuery(start=u.floor_to(start, u.WIDTHS[width]), end=u.ceil_to(end, u.WIDTHS[width]), width=width,
                         limit=u.PAGE_LIMITS[width][1])
    buckets, _ = await store.query(query, tenants, epoch)
    total = u.Totals()
    for _, groups in buckets:
        for t in groups.values():
            total.add(t)
    return total


def expected(evs: list[m.UsageEvent]) -> u.Totals:
    t = u.Totals()
    for e in evs:
        c = u.contribution(e, BOOK)
        t.add(u.Totals(1, 0, 0, c.input_tokens, c.cached_tokens, c.output_tokens, *c.costs))
    return t


async def test_ingest_counts_each_request_id_once_across_chunks_and_calls(redis: aioredis.Redis) -> None:
    store = UsageStore(redis)
    now = time.time()
    big = events(
        "big", MAX_EVENTS_PER_ROUND_TRIP + MAX_EVENTS_PER_CALL + 7, now - 600, 300
    )  # several calls, round trips
    small = events("small", 20, now - 100)
    batch = big + small + big[:40]  # the same request ids again within one batch
    counted = await store.ingest([u.contribution(e, BOOK) for e in batch], epoch=0)
    assert counted == [True] * (len(big) + len(small)) + [False] * 40
    assert await totals(store, ["big"], now - 3600, now) == expected(big)
    assert await totals(store, ["small"], now - 3600, now) == expected(small)
    # Everything again (a redelivery): nothing changes.
    assert not any(await store.ingest([u.contribution(e, BOOK) for e in big + small], epoch=0))
    assert await totals(store, ["big", "small"], now - 3600, now) == expected(big + small)
    for width in ("1m", "1h"):
        assert await totals(store, ["big"], now - 3600, now, width) == expected(big)
    assert await store.tenants() == ["big", "small"]


async def test_old_minutes_are_not_kept_but_hours_and_days_are(redis: aioredis.Redis) -> None:
    store = UsageStore(redis, minute_retention_s=3600)
    now = time.time()
    old = events("t", 10, now - 3 * 3600)
    await store.ingest([u.contribution(e, BOOK) for e in old], epoch=0)
    assert (await totals(store, ["t"], now - 4 * 3600, now, "1m")).requests == 0
    assert (await totals(store, ["t"], now - 4 * 3600, now, "1h")).requests == 10
    ttl = await redis.ttl(f"inferbus:{{t:t}}:usage:0:h:{u.floor_to(now - 3 * 3600, 3600)}")
    assert ttl > 300 * 86400


async def test_epochs_keep_generations_apart(redis: aioredis.Redis) -> None:
    store = UsageStore(redis)
    now = time.time()
    evs = events("t", 5, now - 60)
    await store.ingest([u.contribution(e, BOOK) for e in evs], epoch=0)
    assert await store.state.bump_epoch() == 1
    assert (await totals(store, ["t"], now - 3600, now)).requests == 0  # the new generation starts empty
    assert all(await store.ingest([u.contribution(e, BOOK) for e in evs], epoch=1))  # and counts them anew
    assert (await totals(store, ["t"], now - 3600, now, epoch=0)).requests == 5
    assert await store.delete_other_epochs(1) > 0
    assert (await totals(store, ["t"], now - 3600, now, epoch=0)).requests == 0
    assert (await totals(store, ["t"], now - 3600, now)).requests == 5


async def test_the_price_book_is_seeded_once_and_reloaded_on_change(redis: aioredis.Redis) -> None:
    prices = PriceStore(redis, default=DEFAULT)
    assert await prices.seed(DEFAULT)
    assert not await prices.seed(Prices(9, 9, 9))  # a restart with other settings changes nothing
    book = await prices.book()
    assert book.price_at("m", None, 0) == DEFAULT
    assert await prices.book() is book  # no change, no reload
    await prices.put(PriceVersion("m", "*", 1000.0, Prices(1, 2, 3, 0.25)))
    changed = await prices.book()
    assert changed is not book
    assert changed.price_at("m", "x", 999) == DEFAULT and changed.price_at("m", "x", 1000).output_per_mtok == 2
    epoch, version, minutes = await UsageStore(redis).state.snapshot()
    assert (epoch, version, minutes) == (0, 2, 48 * 3600)
