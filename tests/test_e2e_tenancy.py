"""Tenant limits and the overload policy as a tenant's code sees them (official openai SDK)."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok

from .conftest import MODEL, Platform, read_usage, running_platform
from .waiting import await_for, wait_for

pytestmark = pytest.mark.e2e


def client_for(platform: Platform, key: str, **options: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=platform.base_url, api_key=key, **{"max_retries": 0, **options})  # type: ignore[arg-type]


def ask(client: openai.OpenAI, max_tokens: int = 3):  # type: ignore[no-untyped-def]
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
    )


def test_requests_per_minute_limit_is_a_429_with_retry_headers(platform: Platform) -> None:
    _, key = platform.new_tenant(limits={"requests_per_minute": 3})
    client = client_for(platform, key)
    ok = ask(client)
    assert ok.headers["x-ratelimit-limit-requests"] == "3"
    assert ok.headers["x-ratelimit-remaining-requests"] == "2"
    ask(client)
    ask(client)
    with pytest.raises(openai.RateLimitError) as raised:
        ask(client)
    response = raised.value.response
    assert raised.value.code == "rate_limit_exceeded"
    assert int(response.headers["retry-after"]) >= 1
    assert int(response.headers["retry-after-ms"]) > 0
    assert response.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_spent_budget_is_insufficient_quota_and_the_sdk_does_not_retry(platform: Platform) -> None:
    _, key = platform.new_tenant(limits={"monthly_budget_usd": 0.0000001})
    sent: list[httpx.Request] = []
    client = client_for(platform, key, max_retries=3, http_client=httpx.Client(event_hooks={"request": [sent.append]}))
    with pytest.raises(openai.RateLimitError) as raised:
        ask(client)
    assert raised.value.code == "insufficient_quota"
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1  # no retry, though max_retries=3


def test_concurrency_limit_frees_when_a_request_ends(platform: Platform) -> None:
    _, key = platform.new_tenant(limits={"max_concurrent": 1})
    client = client_for(platform, key, timeout=30)
    with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                        max_tokens=30000, stream=True) as stream:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            ask(client)
    # The stream was closed: the worker aborts, the usage event lands, the lease is released.
    wait_for(lambda: ask(client), 30, interval=0.1, ignore=(openai.RateLimitError,),
             what="the concurrency lease released")


def test_one_at_a_time_never_trips_a_concurrency_limit_of_one(platform: Platform) -> None:
    _, key = platform.new_tenant(limits={"max_concurrent": 1})
    client = client_for(platform, key)
    for _ in range(10):  # each starts right after the previous answer: the slot must be free already
        ask(client)
    with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "s"}],
                                        max_tokens=3, stream=True) as stream:
        list(stream)
    ask(client)


def test_models_a_tenant_may_not_use_look_like_models_that_do_not_exist(platform: Platform) -> None:
    _, key = platform.new_tenant(models=["some-other-model"])
    with pytest.raises(openai.NotFoundError) as raised:
        ask(client_for(platform, key))
    assert raised.value.code == "model_not_found"


def test_reservations_reconcile_exactly_to_the_engine_reported_usage(platform: Platform) -> None:
    import redis.asyncio as aioredis

    from inferbus.stores.admission import Admission
    from inferbus.stores.pricing import Prices

    tenant, key = platform.new_tenant(limits={"monthly_budget_usd": 100.0})
    client = client_for(platform, key)
    # max_tokens 500 reserves far more than a request stopped after a few words uses; greedy
    # output is deterministic, so a word of it makes a stop sequence.
    messages = [{"role": "user", "content": "reconcile"}]
    baseline = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=20,
                                                                temperature=0)
    words = (baseline.parse().choices[0].message.content or "").split()
    ids = [baseline.headers["x-request-id"]] + [client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=500, temperature=0, stop=[" " + words[3]],
    ).headers["x-request-id"] for _ in range(3)]
    events = read_usage(platform, tenant, set(ids))
    assert all(e.usage.completion_tokens <= 20 for e in events)
    prices = Prices(0.60, 0.90, 0.15)  # the platform's default price book
    # Billed in whole micro-dollars per token kind (inferbus/stores/pricing.py), as /v1/costs shows.
    actual = sum(prices.cost_micro(e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.cached_tokens)
                 for e in events) / 1_000_000

    async def spend() -> float:
        redis = aioredis.from_url(platform.stack.redis_url)
        try:
            return await Admission(redis).spend_this_month(tenant)
        finally:
            await redis.aclose()

    # Estimates are replaced by actual cost.
    wait_for(lambda: abs(asyncio.run(spend()) - actual) <= 1e-6, 10, interval=0.2,
             what=f"spend reconciled to {actual}")


@pytest.fixture
def second_gateway(platform: Platform) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "NATS_URL": platform.stack.nats_url, "REDIS_URL": platform.stack.redis_url,
           "INFERBUS_GATEWAY_PORT": str(port), "INFERBUS_MODEL": MODEL, "INFERBUS_LOG_LEVEL": "warning",
           "INFERBUS_MODEL_DIR": platform.stack.model_dir}
    process = subprocess.Popen([sys.executable, "-m", "tools.commands.main", "gateway"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def started() -> bool:
        assert process.poll() is None, "the second gateway exited"
        return http_ok(url + "/ready")

    try:
        # A gateway's start (imports, tokenizer, model directory) takes tens of seconds on a busy
        # machine, and it failed to be ready within 60 s under competing load: the wait ends when it is.
        wait_for(started, 240, interval=0.1, what="the second gateway ready")
        # It learns the workers from their heartbeats: wait until it knows as many as the first.
        workers = httpx.get(platform.stack.gateway_url + "/ready").json()["workers"]
        wait_for(lambda: httpx.get(url + "/ready").json()["workers"] >= workers, 60,
                 what=f"the second gateway knows all {workers} workers")
        yield url
    finally:  # a gateway that never became ready is stopped too
        process.terminate()
        process.wait(10)


def test_two_gateways_do_not_give_a_tenant_twice_its_limit(platform: Platform, second_gateway: str) -> None:
    _, key = platform.new_tenant(limits={"requests_per_minute": 10})
    urls = [platform.base_url, second_gateway + "/v1"]

    async def hammer() -> list[int]:
        async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {key}"}) as http:
            async def one(i: int) -> int:
                response = await http.post(f"{urls[i % 2]}/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
                return response.status_code
            return await asyncio.gather(*(one(i) for i in range(40)))

    started = time.monotonic()
    statuses = asyncio.run(hammer())
    took = time.monotonic() - started
    # 10 per minute, refilling at 1 every 6 s: a burst of 40 over both gateways gets 10, and one
    # more for each 6 s it took (a loaded machine admits it slowly), not 20.
    assert 10 <= statuses.count(200) <= 10 + math.ceil(took / 6), (took, statuses)
    assert statuses.count(429) == 40 - statuses.count(200)


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One worker with two slots, so that any real traffic contends for it, and a short standard
    queue budget, so that a flood overloads it quickly (premium tenants wait up to 30 s)."""
    with running_platform(tmp_path_factory.mktemp("tight"), workers=1, time_scale=0.1,
                             extra_env={"INFERBUS_WORKER_MAX_RUNNING": "2", "INFERBUS_QUEUE_BUDGET_STANDARD_S": "0.3",
                                        "INFERBUS_QUEUE_BUDGET_PREMIUM_S": "30"}) as running:
        yield running


class _Tally:
    """Requests completed per tenant key, and when to stop sending."""

    def __init__(self) -> None:
        self.done: dict[str, int] = {}
        self.stop = asyncio.Event()

    def total(self) -> int:
        return sum(self.done.values())


async def _closed_loop(platform: Platform, key: str, streams: int, tally: _Tally) -> None:
    """`streams` clients of one tenant, each sending the next request as soon as one finishes,
    until `tally.stop` is set; completions are counted in `tally` only while it is not."""
    tally.done.setdefault(key, 0)
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {key}"}) as http:
        async def loop() -> None:
            while not tally.stop.is_set():
                response = await http.post(f"{platform.base_url}/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "fair"}], "max_tokens": 40})
                if response.status_code == 200 and not tally.stop.is_set():
                    tally.done[key] += 1

        await asyncio.gather(*(loop() for _ in range(streams)))


def _engine_holds(platform: Platform) -> int:
    """Requests the (one) engine holds now, running or waiting."""
    loads = httpx.get(f"{platform.engine_url(1)}/v1/loads", params={"include": "all"}, timeout=10).json()["loads"]
    return sum(entry["num_running_reqs"] + entry["num_waiting_reqs"] for entry in loads)


def test_a_tenant_sending_ten_times_more_gets_no_more_than_its_share(tight: Platform) -> None:
    # Both premium: fair share between tenants of one band, with a queue budget that sheds nothing.
    # Counted in requests, not in seconds: the share is taken while both tenants send, over as
    # many completions as it takes, so a machine busy with other work slows both alike.
    contended = tight
    _, heavy = contended.new_tenant(band="premium")
    _, light = contended.new_tenant(band="premium")

    async def both() -> _Tally:
        tally = _Tally()
        clients = asyncio.gather(_closed_loop(contended, heavy, 20, tally), _closed_loop(contended, light, 4, tally))
        try:
            await await_for(lambda: tally.total() >= 40, 240, what="40 requests completed between the two tenants")
        finally:
            tally.stop.set()
            await clients
        return tally

    tally = asyncio.run(both())
    heavy_done, light_done = tally.done[heavy], tally.done[light]
    share = light_done / (heavy_done + light_done)
    # First come, first served would give the light tenant about 4/24 ≈ 17%; equal weights: 50%. Its
    # four clients keep a request of its own waiting whenever a slot frees, however slowly a busy
    # machine turns each answer into the next request (with two, under load 15 it often had none).
    assert 0.35 <= share <= 0.65, (heavy_done, light_done)

    # Idle capacity is not withheld: alone, the heavy tenant gets all of it, both slots at once,
    # and not only for its first requests (which go out before the fair queue holds any).
    async def alone() -> None:
        tally = _Tally()
        clients = asyncio.gather(_closed_loop(contended, heavy, 20, tally))
        try:
            await await_for(lambda: tally.total() >= 10, 240, what="10 requests of the heavy tenant alone")

            async def both_slots() -> bool:
                return await asyncio.to_thread(_engine_holds, contended) == 2

            await await_for(both_slots, 60, interval=0.02, what="the heavy tenant alone on both slots")
        finally:
            tally.stop.set()
            await clients

    asyncio.run(alone())


def test_an_overloaded_platform_sheds_standard_with_503_and_keeps_serving_premium(tight: Platform) -> None:
    _, standard = tight.new_tenant()
    _, premium = tight.new_tenant(band="premium")

    async def flood() -> tuple[list[httpx.Response], list[int]]:
        async with httpx.AsyncClient(timeout=60) as http:
            async def one(key: str) -> httpx.Response:
                return await http.post(
                    f"{tight.base_url}/chat/completions",
                    headers={"authorization": f"Bearer {key}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40},
                )

            shed: list[httpx.Response] = []
            premium_statuses: list[int] = []
            stop_at = time.monotonic() + 6
            while time.monotonic() < stop_at and not shed:
                wave = await asyncio.gather(*(one(standard) for _ in range(30)), one(premium))
                shed += [r for r in wave[:-1] if r.status_code == 503]
                premium_statuses.append(wave[-1].status_code)
            return shed, premium_statuses

    shed, premium_statuses = asyncio.run(flood())
    assert shed, "a flood far beyond capacity must shed standard requests"
    error = shed[0].json()["error"]
    assert error["code"] == "overloaded" and int(shed[0].headers["retry-after"]) >= 1
    assert set(premium_statuses) == {200}  # premium is shed last
