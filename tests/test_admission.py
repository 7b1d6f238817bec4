"""Admission against a real Redis (started here on a free port), and its pure header helpers."""

from __future__ import annotations

import asyncio
import calendar
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from inferbus.local.ports import free_port
from inferbus.stores.admission import (
    _PRELUDE,
    Admission,
    AdmissionUnavailable,
    Decision,
    TenantLimits,
    openai_duration,
    tenant_prefix,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.from_url(redis_url)
    yield redis
    await redis.aclose()


@pytest.fixture
def tenant() -> str:
    return "t-" + uuid.uuid4().hex[:8]


def rid() -> str:
    return uuid.uuid4().hex


async def probe(admission: Admission, tenant: str, limits: TenantLimits) -> Decision:
    """An admit that needs no tokens and no money: shows the buckets' state (takes one request)."""
    decision = await admission.admit(tenant, limits, rid(), 0, 0, 0.0)
    assert decision.admitted, decision
    return decision


def seconds_to_next_utc_month(now: float) -> float:
    today = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    year, month = (today.year + 1, 1) if today.month == 12 else (today.year, today.month + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - now


# ---- pure helpers --------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-3, "0s"), (0.0001, "1ms"), (0.12, "120ms"), (0.999, "999ms"), (1, "1s"), (8.64, "8.64s"),
    (59.9991, "1m0s"), (60, "1m0s"), (360, "6m0s"), (61.5, "1m1.5s"), (3723.5, "1h2m3.5s"), (7200, "2h0m0s"),
])
def test_openai_duration_format(seconds: float, text: str) -> None:
    assert openai_duration(seconds) == text


def test_headers_of_an_admitted_decision_carry_limits_only() -> None:
    decision = Decision(admitted=True, reason="ok", retry_after_s=0.0,
                        limits={"requests": 60, "tokens": 1500, "input_tokens": 1000, "output_tokens": 500},
                        remaining={"requests": 59, "tokens": 1300, "input_tokens": 900, "output_tokens": 400},
                        reset_s={"requests": 1.0, "tokens": 12.0, "input_tokens": 6.0, "output_tokens": 12.0})
    assert decision.headers() == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "1500", "x-ratelimit-remaining-tokens": "1300", "x-ratelimit-reset-tokens": "12s",
    }


def test_headers_of_a_refusal_say_when_to_retry() -> None:
    refused = Decision(admitted=False, reason="requests", retry_after_s=0.2, limits={"requests": 10},
                       remaining={"requests": 0}, reset_s={"requests": 5.5})
    headers = refused.headers()
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "200"
    assert headers["x-ratelimit-reset-requests"] == "5.5s" and "x-should-retry" not in headers
    assert "x-ratelimit-limit-tokens" not in headers
    later = Decision(admitted=False, reason="input_tokens", retry_after_s=2.0001, limits={}, remaining={}, reset_s={})
    assert later.headers() == {"retry-after": "3", "retry-after-ms": "2001"}
    budget = Decision(admitted=False, reason="budget", retry_after_s=86400.0, limits={}, remaining={}, reset_s={},
                      retryable=False)
    assert budget.headers() == {"retry-after": "86400", "retry-after-ms": "86400000", "x-should-retry": "false"}


async def test_the_month_computed_in_lua_matches_the_utc_calendar(client: aioredis.Redis) -> None:
    months = client.register_script(_PRELUDE + "local m, left = month_of(tonumber(ARGV[1])) return {m, left}")
    instants = [calendar.timegm(t) + delta for t in [
        (1970, 1, 1, 0, 0, 0), (2000, 2, 29, 12, 0, 0), (2024, 2, 29, 23, 59, 59), (2024, 3, 1, 0, 0, 0),
        (2025, 12, 31, 23, 59, 59), (2026, 1, 1, 0, 0, 0), (2100, 2, 28, 0, 0, 0), (2100, 3, 1, 0, 0, 0),
    ] for delta in (-1, 0, 1)]
    instants += [946_684_800 + i * 7_654_321 for i in range(150)]  # every month from 2000 to 2036, odd hours
    for instant in instants:
        month, left = await months(args=[instant])
        expected = dt.datetime.fromtimestamp(instant, dt.timezone.utc).strftime("%Y-%m")
        assert (month.decode(), left) == (expected, seconds_to_next_utc_month(instant)), instant


# ---- each dimension ------------------------------------------------------------------------------

async def test_requests_per_minute(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(requests_per_minute=2)
    for _ in range(2):
        assert (await admission.admit(tenant, limits, rid(), 10, 10, 0.0)).admitted
    refused = await admission.admit(tenant, limits, rid(), 10, 10, 0.0)
    assert (refused.admitted, refused.reason) == (False, "requests")
    assert 29.0 < refused.retry_after_s <= 30.0  # one request refills every 30 s
    assert refused.limits["requests"] == 2 and refused.remaining["requests"] == 0
    headers = refused.headers()
    assert headers["retry-after"] == "30" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in headers  # tokens are unlimited for this tenant


async def test_input_tokens_per_minute(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(input_tokens_per_minute=1000)
    assert (await admission.admit(tenant, limits, rid(), 600, 0, 0.0)).admitted
    refused = await admission.admit(tenant, limits, rid(), 600, 0, 0.0)
    assert (refused.admitted, refused.reason, refused.retryable) == (False, "input_tokens", True)
    assert 11.8 < refused.retry_after_s <= 12.0  # 200 tokens short at 1000/60 per second
    assert refused.limits["tokens"] == 1000 and refused.remaining["tokens"] == 400
    assert (await admission.admit(tenant, limits, rid(), 400, 0, 0.0)).admitted  # the refusal took nothing


async def test_output_tokens_per_minute_count_max_tokens(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(input_tokens_per_minute=10_000, output_tokens_per_minute=600)
    first = await admission.admit(tenant, limits, rid(), 5, 500, 0.0)
    assert first.admitted and first.remaining["output_tokens"] == 100
    assert first.limits["tokens"] == 10_600 and first.remaining["tokens"] == 9_995 + 100
    refused = await admission.admit(tenant, limits, rid(), 5, 200, 0.0)
    assert (refused.admitted, refused.reason) == (False, "output_tokens")
    assert 9.9 < refused.retry_after_s <= 10.0  # 100 tokens short at 10 per second


async def test_a_request_larger_than_a_bucket_is_not_retryable(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    refused = await admission.admit(tenant, TenantLimits(input_tokens_per_minute=1000), rid(), 1001, 0, 0.0)
    assert (refused.admitted, refused.reason, refused.retryable) == (False, "input_tokens", False)
    assert refused.headers()["x-should-retry"] == "false"


async def test_the_refusal_reported_is_the_one_to_wait_longest_for(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(requests_per_minute=1, input_tokens_per_minute=6000)
    assert (await admission.admit(tenant, limits, rid(), 6000, 0, 0.0)).admitted
    refused = await admission.admit(tenant, limits, rid(), 600, 0, 0.0)
    # input tokens would be back in 6 s, but the next request only in 60 s
    assert refused.reason == "requests" and refused.retry_after_s > 59


async def test_buckets_refill_from_redis_time(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(input_tokens_per_minute=60)  # one token per second
    assert (await admission.admit(tenant, limits, rid(), 60, 0, 0.0)).admitted
    refused = await admission.admit(tenant, limits, rid(), 1, 0, 0.0)
    assert refused.reason == "input_tokens" and 0.9 < refused.retry_after_s <= 1.0
    await asyncio.sleep(refused.retry_after_s + 0.05)
    assert (await admission.admit(tenant, limits, rid(), 1, 0, 0.0)).admitted
    again = await admission.admit(tenant, limits, rid(), 1, 0, 0.0)
    assert not again.admitted and again.remaining["input_tokens"] == 0


async def test_a_refusal_takes_nothing(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(requests_per_minute=10, input_tokens_per_minute=1000, output_tokens_per_minute=1000,
                          max_concurrent=5, monthly_budget_usd=10.0)
    assert (await admission.admit(tenant, limits, rid(), 100, 900, 1.0)).admitted
    before = await probe(admission, tenant, limits)
    spend = await admission.spend_this_month(tenant)
    refused_id = rid()
    refused = await admission.admit(tenant, limits, refused_id, 500, 500, 2.0)
    assert (refused.admitted, refused.reason) == (False, "output_tokens")
    after = await probe(admission, tenant, limits)
    assert after.remaining["requests"] == before.remaining["requests"] - 1  # only the probe's request
    assert after.remaining["input_tokens"] == before.remaining["input_tokens"]
    assert after.remaining["concurrency"] == before.remaining["concurrency"] - 1  # only the probe's lease
    assert await admission.spend_this_month(tenant) == spend
    assert not await client.exists(tenant_prefix(tenant) + "res:" + refused_id)
    assert await client.zscore(tenant_prefix(tenant) + "leases", refused_id) is None


# ---- concurrency leases --------------------------------------------------------------------------

async def test_concurrency_is_released_by_reconcile(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(max_concurrent=2)
    first, second = rid(), rid()
    assert (await admission.admit(tenant, limits, first, 1, 1, 0.0)).admitted
    assert (await admission.admit(tenant, limits, second, 1, 1, 0.0)).admitted
    refused = await admission.admit(tenant, limits, rid(), 1, 1, 0.0)
    assert (refused.admitted, refused.reason) == (False, "concurrency")
    assert 0 < refused.retry_after_s <= 1 and refused.remaining["concurrency"] == 0
    assert await admission.reconcile(tenant, first, 1, 1, 0.0)
    assert (await admission.admit(tenant, limits, rid(), 1, 1, 0.0)).admitted


async def test_a_crashed_holders_lease_expires(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client, lease_ttl_s=0.5)
    limits = TenantLimits(max_concurrent=1)
    assert (await admission.admit(tenant, limits, rid(), 1, 1, 0.0)).admitted  # never reconciled
    refused = await admission.admit(tenant, limits, rid(), 1, 1, 0.0)
    assert refused.reason == "concurrency" and refused.retry_after_s <= 0.5
    await asyncio.sleep(0.6)
    assert (await admission.admit(tenant, limits, rid(), 1, 1, 0.0)).admitted


# ---- reconcile -----------------------------------------------------------------------------------

async def test_reconcile_refunds_unused_output_exactly_once(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(input_tokens_per_minute=60_000, output_tokens_per_minute=60_000)
    request = rid()
    admitted = await admission.admit(tenant, limits, request, 1000, 50_000, 0.0)
    assert admitted.remaining["output_tokens"] == 10_000
    assert await admission.reconcile(tenant, request, 1000, 2_000, 0.0)
    # 48,000 unused tokens came back; refill over these milliseconds adds a few more
    refunded = (await probe(admission, tenant, limits)).remaining["output_tokens"]
    assert 58_000 <= refunded < 58_100
    assert not await admission.reconcile(tenant, request, 1000, 2_000, 0.0)
    assert (await probe(admission, tenant, limits)).remaining["output_tokens"] < refunded + 100
    assert not await client.exists(tenant_prefix(tenant) + "res:" + request)


async def test_reconcile_takes_usage_beyond_the_reservation(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(input_tokens_per_minute=600)  # 10 tokens per second
    request = rid()
    assert (await admission.admit(tenant, limits, request, 100, 0, 0.0)).admitted
    assert await admission.reconcile(tenant, request, 700, 0, 0.0)  # 600 - 700: 100 below zero now
    refused = await admission.admit(tenant, limits, rid(), 1, 0, 0.0)
    assert refused.reason == "input_tokens" and refused.remaining["input_tokens"] == 0
    assert 10.0 < refused.retry_after_s <= 10.1  # (1 + 100) tokens at 10 per second


async def test_budget_reserves_estimates_and_settles_actual_cost(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(monthly_budget_usd=1.0)
    request = rid()
    assert (await admission.admit(tenant, limits, request, 10, 10, 0.6)).admitted
    assert await admission.spend_this_month(tenant) == 0.6
    refused = await admission.admit(tenant, limits, rid(), 10, 10, 0.6)
    assert (refused.admitted, refused.reason, refused.retryable) == (False, "budget", False)
    assert abs(refused.retry_after_s - seconds_to_next_utc_month(time.time())) < 5
    headers = refused.headers()
    assert headers["x-should-retry"] == "false" and int(headers["retry-after"]) >= 1
    assert await admission.reconcile(tenant, request, 10, 3, 0.2)
    assert await admission.spend_this_month(tenant) == 0.2
    assert (await admission.admit(tenant, limits, rid(), 10, 10, 0.6)).admitted
    assert await admission.spend_this_month(tenant) == 0.8
    # micro-dollars: many small costs add up without float drift
    for _ in range(10):
        assert await admission.reconcile(tenant, rid(), 1, 1, 0.1)
    assert await admission.spend_this_month(tenant) == 1.8


async def test_reconcile_without_a_reservation_records_spend_once(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    request = rid()
    assert await admission.reconcile(tenant, request, 100, 50, 0.25)
    assert not await admission.reconcile(tenant, request, 100, 50, 0.25)
    assert await admission.spend_this_month(tenant) == 0.25


async def test_every_key_of_a_tenant_is_in_one_cluster_slot(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(requests_per_minute=10, input_tokens_per_minute=100, max_concurrent=3)
    request = rid()
    await admission.admit(tenant, limits, request, 1, 1, 0.01)
    keys = [key async for key in client.scan_iter(match=tenant_prefix(tenant) + "*")]
    await admission.reconcile(tenant, request, 1, 1, 0.01)
    keys += [key async for key in client.scan_iter(match=tenant_prefix(tenant) + "*")]
    kinds = {key.decode().removeprefix(tenant_prefix(tenant)).split(":")[0] for key in keys}
    assert kinds == {"quota", "leases", "res", "done"}
    assert len({key_slot(key) for key in keys}) == 1


# ---- Redis trouble -------------------------------------------------------------------------------

async def test_scripts_come_back_after_a_redis_restart(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    assert (await admission.admit(tenant, TenantLimits(requests_per_minute=5), rid(), 1, 1, 0.0)).admitted
    await client.script_flush()  # what a restarted Redis looks like to EVALSHA
    assert (await admission.admit(tenant, TenantLimits(requests_per_minute=5), rid(), 1, 1, 0.0)).admitted


async def test_reconcile_many_reconciles_each_once_and_survives_a_lost_script_cache(client: aioredis.Redis,
                                                                                     tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(max_concurrent=2)
    first, second, third = rid(), rid(), rid()
    for request in (first, second):
        assert (await admission.admit(tenant, limits, request, 10, 10, 0.0)).admitted
    assert not (await admission.admit(tenant, limits, third, 10, 10, 0.0)).admitted  # both slots held
    await client.script_flush()  # what a restarted Redis looks like to EVALSHA
    assert await admission.reconcile_many([(tenant, first, 10, 5, 0.0), (tenant, second, 10, 5, 0.0)]) == [True, True]
    assert await admission.reconcile_many([(tenant, first, 10, 5, 0.0)]) == [False]  # once only
    assert (await admission.admit(tenant, limits, third, 10, 10, 0.0)).admitted  # the slots came back


async def test_a_lost_script_is_loaded_where_the_call_runs(client: aioredis.Redis, tenant: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failover the promoted replica may never have run the scripts, while a pooled
    connection still reaches the old primary: loading through the pool would load them there.
    The reload goes with the call, on its own connection (the pool's loader here stands for the
    old primary: gone)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    admission = Admission(client)
    limits = TenantLimits(max_concurrent=2)
    first, second = rid(), rid()
    assert (await admission.admit(tenant, limits, first, 10, 10, 0.0)).admitted

    async def old_primary(*args: object) -> None:
        raise RedisConnectionError("the old primary is gone")

    monkeypatch.setattr(client, "script_load", old_primary)
    await client.script_flush()
    assert (await admission.admit(tenant, limits, second, 10, 10, 0.0)).admitted
    await client.script_flush()
    assert await admission.reconcile_many([(tenant, first, 10, 5, 0.0), (tenant, second, 10, 5, 0.0)]) == [True, True]


async def test_concurrent_admits_share_round_trips_and_each_gets_its_own_answer(client: aioredis.Redis,
                                                                                 tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(requests_per_minute=30)
    await probe(admission, "other-" + tenant, limits)  # the script is loaded (a fresh Redis answers NOSCRIPT once)
    before = (await client.info("commandstats"))["cmdstat_evalsha"]["calls"]
    connections = {c["id"] for c in await client.client_list()}
    decisions = await asyncio.gather(*(admission.admit(tenant, limits, rid(), 1, 1, 0.0) for _ in range(50)))
    assert sum(decision.admitted for decision in decisions) == 30
    assert {decision.reason for decision in decisions if not decision.admitted} == {"requests"}
    assert (await client.info("commandstats"))["cmdstat_evalsha"]["calls"] - before == 50  # each ran once
    assert {c["id"] for c in await client.client_list()} <= connections  # on the one the probe opened
    await admission.aclose()


async def test_admission_reconnects_after_redis_drops_its_connection(client: aioredis.Redis, tenant: str) -> None:
    admission = Admission(client)
    limits = TenantLimits(requests_per_minute=10)
    assert (await admission.admit(tenant, limits, rid(), 1, 1, 0.0)).admitted
    killed = await client.client_kill_filter(_type="normal", skipme=True)  # as a Redis restart would
    assert killed >= 1
    await asyncio.sleep(0.1)  # the server's close reaches the client
    decision = await admission.admit(tenant, limits, rid(), 1, 1, 0.0)  # on a new connection, not a 503
    assert decision.admitted and decision.limits["requests"] == 10
    await admission.release(tenant, rid())
    await admission.aclose()


async def test_unreachable_redis_fails_closed_or_open_as_configured() -> None:
    dead = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    limits = TenantLimits(requests_per_minute=1)
    with pytest.raises(AdmissionUnavailable):
        await Admission(dead).admit("acme", limits, rid(), 1, 1, 0.0)
    opened = await Admission(dead, on_redis_error="open").admit("acme", limits, rid(), 1, 1, 0.0)
    assert (opened.admitted, opened.reason, opened.limits, opened.headers()) == (True, "ok", {}, {})
    with pytest.raises(AdmissionUnavailable):
        await Admission(dead, on_redis_error="open").reconcile("acme", rid(), 1, 1, 0.0)
    await dead.aclose()
