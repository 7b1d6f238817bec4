"""The console's pure parts (SLO arithmetic, the usage page's sums) and the stores it reads, against
a real Redis: the SLO recorder, keys' last use, quota levels, sessions and CSRF checks."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request

from inferbus.stores import usage as u
from inferbus.stores.admission import Admission, read_quota
from inferbus.stores.keys import KeyStore, issue_key, list_keys, revoke_key
from inferbus.stores.tenants import TenantLimits
from services.gateway.console import slo, usage_view
from services.gateway.console.auth import Forbidden, NotSignedIn, Sessions, Viewer, check_csrf, same_origin
from services.gateway.console.recorder import SloRecorder, read_minutes


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


# ---- SLO arithmetic ------------------------------------------------------------------------------

def counts_in(bounds: tuple[float, ...], values: list[float]) -> list[int]:
    out = [0] * (len(bounds) + 1)
    for value in values:
        out[next((i for i, b in enumerate(bounds) if value <= b), len(bounds))] += 1
    return out


def test_p90_is_read_as_promql_reads_a_histogram() -> None:
    b = slo.LATENCY_BOUNDS
    # All ten samples in (0.2, 0.4]: rank 9 of 10, linear inside the bucket: 0.2 + 0.2 * 9/10.
    assert slo.histogram_quantile(0.9, b, counts_in(b, [0.3] * 10)) == pytest.approx(0.38)
    # In the first bucket, from 0.
    assert slo.histogram_quantile(0.5, b, counts_in(b, [0.001] * 4)) == pytest.approx(0.0025)
    # In +Inf: the highest finite bound, as histogram_quantile answers.
    assert slo.histogram_quantile(0.9, b, counts_in(b, [100.0] * 3)) == 30.0
    assert slo.histogram_quantile(0.9, b, [0] * (len(b) + 1)) is None
    # 91 fast, 9 slow: the p90 is in the fast bucket; 89 fast, 11 slow: in the slow one.
    assert slo.histogram_quantile(0.9, b, counts_in(b, [0.05] * 91 + [1.0] * 9)) <= 0.05
    assert slo.histogram_quantile(0.9, b, counts_in(b, [0.05] * 89 + [1.0] * 11)) > 0.8


def test_share_within_a_budget_is_exact_at_a_bucket_bound() -> None:
    b = slo.LATENCY_BOUNDS
    assert slo.share_within(b, counts_in(b, [0.7] * 3 + [0.9]), 0.8) == 0.75
    assert slo.share_within(b, [0] * (len(b) + 1), 0.8) is None


def test_counts_are_read_from_the_prometheus_objects_summed_over_labels() -> None:
    registry = CollectorRegistry()
    ttft = Histogram("t_ttft_seconds", "", ["model", "band"], buckets=slo.LATENCY_BOUNDS, registry=registry)
    tpot = Histogram("t_tpot_seconds", "", ["model"], buckets=slo.TPOT_BOUNDS, registry=registry)
    requests = Counter("t_requests", "", ["endpoint", "status"], registry=registry)
    shed = Counter("t_shed", "", ["band"], registry=registry)
    for value, band in ((0.03, "premium"), (0.3, "standard"), (0.3, "standard"), (2.0, "premium")):
        ttft.labels("m", band).observe(value)
    tpot.labels("m").observe(0.02)
    requests.labels("chat", "200").inc(7)
    requests.labels("chat", "503").inc(2)
    requests.labels("completion", "500").inc(1)
    shed.labels("standard").inc(2)

    def samples(metric: Any) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for family in metric.collect() for s in family.samples]

    counts = slo.from_samples(samples(ttft), samples(tpot), samples(requests), samples(shed))
    assert counts.ttft == counts_in(slo.LATENCY_BOUNDS, [0.03, 0.3, 0.3, 2.0])
    assert counts.tpot == counts_in(slo.TPOT_BOUNDS, [0.02])
    assert (counts.requests, counts.errors, counts.shed) == (10, 3, 2)


def test_a_counter_that_went_down_was_reset() -> None:
    before = slo.Counts(requests=10, errors=1, ttft=[5] + [0] * len(slo.LATENCY_BOUNDS))
    now = slo.Counts(requests=14, errors=1, ttft=[2] + [0] * len(slo.LATENCY_BOUNDS))
    gained = slo.delta(now, before)
    assert (gained.requests, gained.errors, gained.ttft[0]) == (4, 0, 2)


def test_the_day_counts_quarter_hours_with_traffic_that_met_every_slo() -> None:
    now = 1_800_000_000.0
    minute = int(now // 60) * 60
    good = slo.Counts(requests=100, ttft=counts_in(slo.LATENCY_BOUNDS, [0.1] * 100),
                      tpot=counts_in(slo.TPOT_BOUNDS, [0.02] * 100))
    slow = slo.Counts(requests=100, ttft=counts_in(slo.LATENCY_BOUNDS, [1.5] * 100),
                      tpot=counts_in(slo.TPOT_BOUNDS, [0.02] * 100))
    failing = slo.Counts(requests=100, errors=1, ttft=counts_in(slo.LATENCY_BOUNDS, [0.1] * 100))
    minutes = {minute: good, minute - 3600: slow, minute - 7200: failing, minute - 3 * 86400: slow}
    view = slo.day_view(minutes, now, slo.Budgets())
    assert view.steps_with_traffic == 3  # two days ago is not today's
    assert view.attainment == pytest.approx(1 / 3)
    assert view.now.requests == 100 and view.now.met(slo.Budgets()) is True
    assert view.day.requests == 300 and view.day.error_share == pytest.approx(1 / 300)
    assert slo.point(slow, 0, 60, slo.Budgets()).met(slo.Budgets()) is False


@pytest.mark.slow
async def test_the_recorder_adds_what_the_counters_gained_and_keeps_what_redis_refused(redis: aioredis.Redis) -> None:
    current = [slo.Counts(requests=3, errors=1)]
    clock = [1_800_000_000.0]
    recorder = SloRecorder(redis, read=lambda: current[0], clock=lambda: clock[0])
    assert await recorder.flush()
    current[0] = slo.Counts(requests=5, errors=1, shed=1)
    broken = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    recorder.redis = broken
    assert not await recorder.flush()  # Redis away: nothing lost...
    await broken.aclose()
    recorder.redis = redis
    clock[0] += 60
    assert await recorder.flush()  # ...the next write carries it
    minutes = await read_minutes(redis, int(clock[0]) - 120, int(clock[0]) + 60)
    first, second = int(clock[0] - 60) // 60 * 60, int(clock[0]) // 60 * 60
    assert (minutes[first].requests, minutes[first].errors) == (3, 1)
    assert (minutes[second].requests, minutes[second].errors, minutes[second].shed) == (2, 0, 1)
    assert await redis.ttl(f"inferbus:{{console}}:slo:{first}") > 0


# ---- the usage page -------------------------------------------------------------------------------

NOW = dt.datetime(2026, 12, 6, 4, 30, tzinfo=dt.timezone.utc).timestamp()


def test_the_window_is_whole_utc_days_this_month_by_default() -> None:
    win = usage_view.window(None, None, NOW)
    assert (win.first_day, win.last_day, win.end_day) == ("2026-12-01", "2026-12-06", "2026-12-07")
    assert (
        win.export_command("demo")
        == "inferbus usage export --tenant demo --from 2026-12-01 --to 2026-12-07 --bucket 1d"
    )
    assert (
        usage_view.window("2026-11-30", "2026-11-30", NOW).end
        - usage_view.window("2026-11-30", "2026-11-30", NOW).start
        == 86400
    )
    for start, last, param in (("30-11-2026", None, "from"), ("2026-12-05", "2026-12-01", "to"),
                               ("2024-01-01", "2026-01-01", "from")):
        with pytest.raises(usage_view.WindowError) as error:
            usage_view.window(start, last, NOW)
        assert error.value.param == param


def row(day: str, hour: int, **fields: Any) -> dict[str, Any]:
    start = int(dt.datetime.fromisoformat(day + "T00:00:00+00:00").timestamp()) + hour * 3600
    base = {"tenant": "demo", "start_time": start, "model": "m", "adapter": "", "band": "standard",
            "api_key_id": "key_1", "batch_id": "", "release": "", "num_model_requests": 1, "num_cancelled_requests": 0,
            "num_failed_requests": 0, "input_tokens": 10, "input_cached_tokens": 2, "output_tokens": 5,
            "cost_micro_usd": 7}
    return {**base, **fields}


def test_the_page_is_the_sum_of_the_export_rows() -> None:
    rows = [row("2026-12-01", 3), row("2026-12-01", 4, adapter="a@1", cost_micro_usd=1_000_001),
            row("2026-12-03", 0, model="n", api_key_id="key_2", num_model_requests=2)]
    page = usage_view.summarize(rows, usage_view.window(None, None, NOW), {"key_1": "ci"})
    assert (page.total.requests, page.total.input_tokens, page.total.cached_tokens, page.total.output_tokens) == (
        4,
        30,
        6,
        15,
    )
    assert page.total.cost_usd == "1.000015"
    assert [(d.key, d.sums.requests) for d in page.days] == [("2026-12-01", 2), ("2026-12-03", 2)]
    assert [(line.key, line.label) for line in page.tables["adapter"]] == [("a@1", "a@1"), ("", "(base model)")]
    assert {line.label for line in page.tables["api_key_id"]} == {"ci (key_1)", "key_2"}
    cost = page.charts["cost"]
    assert len(cost["labels"]) == 6 and {d["label"] for d in cost["datasets"]} == {"m", "n"}
    assert sum(sum(d["data"]) for d in cost["datasets"]) == pytest.approx(1.000015)
    assert usage_view.rows_of_tenant([*rows, {**rows[0], "tenant": "other"}], "demo") == rows


# ---- stores the console reads ---------------------------------------------------------------------

@pytest.mark.slow
async def test_a_keys_last_use_is_recorded_once_a_minute_and_forgotten_with_the_key(redis: aioredis.Redis) -> None:
    issued = await issue_key(redis, "acme", "ci")
    clock = [1_800_000_000.0]
    store = KeyStore(redis, cache_ttl_s=0.0, clock=lambda: clock[0])
    assert (await list_keys(redis, "acme"))[0].last_used is None
    writes = 0
    original = redis.hset

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal writes
        writes += 1
        return await original(*args, **kwargs)

    redis.hset = counting  # type: ignore[method-assign]
    for _ in range(20):
        assert await store.lookup(issued.secret) is not None
    await _settle()
    assert writes == 1
    assert (await list_keys(redis, "acme"))[0].last_used == clock[0]
    clock[0] += 61
    await store.lookup(issued.secret)
    await _settle()
    assert writes == 2 and (await list_keys(redis, "acme"))[0].last_used == clock[0]
    redis.hset = original  # type: ignore[method-assign]
    await revoke_key(redis, "acme", issued.id)
    assert not await redis.exists("inferbus:{t:acme}:keys:used") or not await redis.hget(
        "inferbus:{t:acme}:keys:used", issued.id
    )


async def _settle() -> None:
    import asyncio

    for _ in range(20):
        await asyncio.sleep(0.01)


@pytest.mark.slow
async def test_the_quota_read_shows_what_admission_took(redis: aioredis.Redis) -> None:
    limits = TenantLimits(
        requests_per_minute=60, input_tokens_per_minute=6000, max_concurrent=4, monthly_budget_usd=2.0
    )
    admission = Admission(redis)
    try:
        for i in range(3):
            decision = await admission.admit("acme", limits, f"r{i}", 100, 50, 0.25)
            assert decision.admitted
        uses = {use.name: use for use in await read_quota(redis, "acme", limits)}
    finally:
        await admission.aclose()
    assert set(uses) == {"requests_per_minute", "input_tokens_per_minute", "max_concurrent", "monthly_budget_usd"}
    assert 2.9 < uses["requests_per_minute"].used <= 3  # refills at 1 a second: milliseconds have passed
    assert 290 < uses["input_tokens_per_minute"].used <= 300
    assert uses["max_concurrent"].used == 3 and uses["max_concurrent"].share == 0.75
    assert uses["monthly_budget_usd"].used == pytest.approx(0.75)
    fresh = await read_quota(redis, "nobody", limits)
    assert [use.used for use in fresh] == [0, 0, 0, 0]


# ---- sessions and CSRF ------------------------------------------------------------------------------

def request(headers: dict[str, str] | None = None, cookies: str = "", method: str = "POST") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    raw.append((b"host", b"console.test"))
    if cookies:
        raw.append((b"cookie", cookies.encode()))
    return Request({"type": "http", "method": method, "path": "/console/keys", "headers": raw, "query_string": b""})


def test_csrf_needs_the_sessions_token_from_this_site() -> None:
    viewer = Viewer(role="tenant", tenant="acme", key_id="k", csrf="the-token", session_id="s")
    check_csrf(request(), viewer, "the-token")
    check_csrf(request({"origin": "http://console.test", "sec-fetch-site": "same-origin"}), viewer, "the-token")
    for headers, token in (({}, None), ({}, "other"), ({"origin": "https://evil.example"}, "the-token"),
                           ({"origin": "null"}, "the-token"), ({"sec-fetch-site": "cross-site"}, "the-token"),
                           ({"sec-fetch-site": "same-site"}, "the-token")):
        with pytest.raises(Forbidden):
            check_csrf(request(headers), viewer, token)
    # A bearer key is no ambient credential: nothing to forge.
    check_csrf(request({"origin": "https://evil.example"}), Viewer("tenant", "acme", "k", ""), None)
    assert same_origin(request({"origin": "http://console.test"}))


@pytest.mark.slow
async def test_a_session_lasts_while_its_key_does(redis: aioredis.Redis) -> None:
    issued = await issue_key(redis, "acme", "ci")
    sessions = Sessions(redis, KeyStore(redis, cache_ttl_s=0.0), "ib-admin-secret", idle_s=60, max_age_s=3600)
    assert await sessions.identify("ib-wrong") is None
    session = await sessions.identify(issued.secret)
    assert session is not None and (session.role, session.tenant, session.key_id) == ("tenant", "acme", issued.id)
    session_id = await sessions.open(session)
    stored = [key async for key in redis.scan_iter("inferbus:console:session:*")]
    assert len(stored) == 1 and session_id.encode() not in stored[0]  # Redis holds its hash only
    assert issued.secret.encode() not in await redis.get(stored[0])
    assert 0 < await redis.ttl(stored[0]) <= 60  # idle_s without a page view ends it
    viewer = await sessions.viewer(request(cookies=f"inferbus_console={session_id}", method="GET"))
    assert (viewer.tenant, viewer.csrf) == ("acme", session.csrf)
    await revoke_key(redis, "acme", issued.id)
    with pytest.raises(NotSignedIn):
        await sessions.viewer(request(cookies=f"inferbus_console={session_id}", method="GET"))

    admin = await sessions.identify("ib-admin-secret")
    assert admin is not None and admin.role == "admin"
    admin_id = await sessions.open(admin)
    assert (await sessions.viewer(request(cookies=f"inferbus_console={admin_id}"))).admin
    sessions.admin_key = "ib-admin-rotated"  # a new admin key ends the old key's sessions
    with pytest.raises(NotSignedIn):
        await sessions.viewer(request(cookies=f"inferbus_console={admin_id}"))

    old = await sessions.identify("ib-admin-rotated")
    assert old is not None
    old.created = time.time() - 7200  # past max_age_s
    with pytest.raises(NotSignedIn):
        await sessions.viewer(request(cookies=f"inferbus_console={await sessions.open(old)}"))
    bearer = await sessions.viewer(request({"authorization": "Bearer ib-admin-rotated"}))
    assert bearer.admin and bearer.session_id == "" and bearer.csrf == ""


def test_usage_totals_round_trip_exactly() -> None:
    """Dollars are summed in micro-dollars and written as the export writes them."""
    sums = usage_view.Sums()
    for _ in range(3):
        sums.add(row("2026-12-01", 0, cost_micro_usd=333_333))
    assert sums.cost_usd == u.usd_text(999_999) == "0.999999"


def test_the_session_cookie_is_httponly_strict_and_secure_over_https() -> None:
    from starlette.responses import Response

    from services.gateway.console.pages import _set_cookie

    for scheme, secure in (("http", False), ("https", True)):
        scope = {"type": "http", "method": "GET", "path": "/console/", "headers": [(b"host", b"console.test")],
                 "query_string": b"", "scheme": scheme}
        response = Response()
        _set_cookie(response, Request(scope), "inferbus_console", "value", max_age=None)
        parts = {p.strip().lower() for p in response.headers["set-cookie"].split(";")}
        assert {"httponly", "samesite=strict", "path=/console"} <= parts
        assert ("secure" in parts) is secure
