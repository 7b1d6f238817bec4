"""Billing end to end, against real nats-server, Redis and every service as processes.

Clients use the official openai SDK; usage comes back through GET /v1/usage and /v1/costs, the
admin API and the `inferbus usage` CLI. The fault checks publish usage events straight onto the
ledger (the `USAGE` stream) and then break things: SIGKILL the billing service mid-stream,
duplicate events under new stream sequences, lose every rollup and rebuild from the ledger.
"""

from __future__ import annotations

import asyncio
import calendar
import csv
import datetime as dt
import io
import secrets
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from inferbus.stores.pricing import PriceBook, Prices
from proto import messages as m
from proto import subjects

from . import waiting
from .conftest import MODEL, Platform, read_usage, running_platform
from .ledger import rollup_drained

pytestmark = pytest.mark.e2e
DEFAULT = Prices(0.60, 0.90, 0.15, 0.5)  # the billing service's default price book


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    tmp = tmp_path_factory.mktemp("billing")
    with running_platform(tmp, workers=1, time_scale=0.1,
                          extra_env={"INFERBUS_EXPORT_DIR": str(tmp / "exports"), "INFERBUS_BILLING_ACK_WAIT_S": "3",
                                     "INFERBUS_BILLING_BATCH": "200"}) as running:
        yield running


# ---- helpers --------------------------------------------------------------------------------------

def new_tenant(platform: Platform, **fields: object) -> tuple[str, str, str]:
    """A tenant with one key: (tenant id, secret, key id)."""
    tenant = platform.create_tenant(**fields)
    return (tenant, *platform.new_key(tenant))


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """`waiting.wait_for`, polling every 0.2 s for 20 s unless told (the rollups lag by a batch)."""
    return waiting.wait_for(check, timeout, interval=0.2, what=what)


def usage_page(platform: Platform, key: str, path: str = "/usage", **params: Any) -> dict[str, Any]:
    response = httpx.get(
        platform.base_url + path, params=params, headers={"authorization": f"Bearer {key}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    return response.json()


def admin_get(platform: Platform, path: str, **params: Any) -> dict[str, Any]:
    with platform.admin() as admin:
        response = admin.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def totals(page: dict[str, Any]) -> dict[str, int]:
    out = {"requests": 0, "input": 0, "cached": 0, "output": 0}
    for bucket in page["data"]:
        for r in bucket["results"]:
            out["requests"] += r["num_model_requests"]
            out["input"] += r["input_tokens"]
            out["cached"] += r["input_cached_tokens"]
            out["output"] += r["output_tokens"]
    return out


def micro(page: dict[str, Any]) -> int:
    return sum(round(r["amount"]["value"] * 1_000_000) for b in page["data"] for r in b["results"])


def tenant_totals(platform: Platform, tenant: str, start: float, end: float) -> dict[str, int]:
    return totals(admin_get(platform, "/usage", tenant=tenant, start_time=int(start), end_time=int(end) + 1,
                            bucket_width="1d", limit=31))


def tenant_cost(platform: Platform, tenant: str, start: float, end: float) -> int:
    return micro(admin_get(platform, "/costs", tenant=tenant, start_time=int(start), end_time=int(end) + 1,
                           bucket_width="1d", limit=31))


def synthetic(tenant: str, n: int, started: float, **fields: Any) -> list[m.UsageEvent]:
    events = []
    for i in range(n):
        prompt = 10 + (i * 37) % 900
        events.append(m.UsageEvent(
            request_id=uuid.uuid4().hex, tenant=tenant, model=fields.get("model", MODEL),
            status=("completed", "cancelled", "failed")[i % 7 % 3],
            usage=m.Usage(prompt_tokens=prompt, completion_tokens=(i * 13) % 300, cached_tokens=prompt // 3),
            started=started + i * 0.01, finished=started + i * 0.01 + 1, api_key_id=f"key_{i % 3}",
            batch_id=fields.get("batch_id"), adapter=fields.get("adapter"),
        ))
    return events


def expected(events: list[m.UsageEvent], book: PriceBook | None = None) -> tuple[dict[str, int], int]:
    book = book or PriceBook([], DEFAULT)
    t = {"requests": len(events), "input": 0, "cached": 0, "output": 0}
    cost = 0
    for e in events:
        t["input"] += e.usage.prompt_tokens
        t["cached"] += e.usage.cached_tokens
        t["output"] += e.usage.completion_tokens
        cost += book.line_costs(e.model, e.adapter, e.started, e.usage.prompt_tokens, e.usage.completion_tokens,
                                e.usage.cached_tokens, batch=bool(e.batch_id)).total
    return t, cost


async def _publish(url: str, events: list[m.UsageEvent], msg_id: Callable[[m.UsageEvent], str],
                   pause_every: int = 0, pause_s: float = 0.0) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    for i, event in enumerate(events):
        ack = await js.publish(
            subjects.usage_subject(event.tenant, subjects.USAGE_FROM_OWNER, "gw"),
            m.encode(event),
            headers={"Nats-Msg-Id": msg_id(event)},
        )
        assert not ack.duplicate
        if pause_every and i % pause_every == pause_every - 1:
            await asyncio.sleep(pause_s)
    await nc.close()


def publish(
    platform: Platform,
    events: list[m.UsageEvent],
    msg_id: Callable[[m.UsageEvent], str] = lambda e: e.request_id,
    **pacing: Any,
) -> None:
    asyncio.run(_publish(platform.stack.nats_url, events, msg_id, **pacing))


def cli(platform: Platform, *args: str) -> str:
    from tools.commands.main import main

    result = CliRunner().invoke(main, list(args), env={"REDIS_URL": platform.stack.redis_url,
                                                       "NATS_URL": platform.stack.nats_url},
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def ask(client: openai.OpenAI, i: int, kind: str) -> tuple[int, int, int]:
    """One request of `kind`; the usage the client received (prompt, cached, completion)."""
    if kind == "chat":
        response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"bill {i}"}],
                                                  max_tokens=5 + i)
        usage = response.usage
    elif kind == "stream":
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"stream {i}"}],
                                                     max_tokens=5 + i, stream=True,
                                                     stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(model=MODEL, prompt=f"complete {i}", max_tokens=5 + i).usage
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return usage.prompt_tokens, cached or 0, usage.completion_tokens


# ---- what clients were told is what they are billed -----------------------------------------------

def test_exports_and_the_usage_api_equal_the_usage_clients_received(platform: Platform, tmp_path: Path) -> None:
    tenant, key, key_id = new_tenant(platform)
    client = openai.OpenAI(base_url=platform.base_url, api_key=key, max_retries=0)
    start = time.time()
    received = [ask(client, i, kind) for i, kind in enumerate(["chat", "stream", "completion"] * 3)]
    want = {"requests": len(received), "input": sum(r[0] for r in received), "cached": sum(r[1] for r in received),
            "output": sum(r[2] for r in received)}

    page = wait_for(
        "the rollup",
        lambda: (
            (p := usage_page(platform, key, start_time=int(start) - 60, group_by="api_key"))
            and totals(p)["requests"] == want["requests"]
            and p
        ),
    )
    assert totals(page) == want
    results = [r for b in page["data"] for r in b["results"]]
    assert {r["api_key_id"] for r in results} == {key_id}
    assert page["object"] == "page" and page["data"][0]["object"] == "bucket"

    for fmt in ("csv", "jsonl", "parquet"):
        out = tmp_path / f"usage.{fmt}"
        cli(platform, "usage", "export", "--tenant", tenant, "--from", str(int(start) - 3600), "--bucket", "1h",
            "--format", fmt, "--out", str(out))
        if fmt == "csv":
            rows = list(csv.DictReader(io.StringIO(out.read_text())))
        elif fmt == "jsonl":
            import json

            rows = [json.loads(line) for line in out.read_text().splitlines()]
        else:
            import pyarrow.parquet as pq

            rows = pq.read_table(out).to_pylist()
        got = {
            "requests": sum(int(r["num_model_requests"]) for r in rows),
            "input": sum(int(r["input_tokens"]) for r in rows),
            "cached": sum(int(r["input_cached_tokens"]) for r in rows),
            "output": sum(int(r["output_tokens"]) for r in rows),
        }
        assert got == want, fmt
        assert {r["tenant"] for r in rows} == {tenant} and {r["api_key_id"] for r in rows} == {key_id}

    costs = usage_page(platform, key, "/costs", start_time=int(start) - 60, group_by="line_item")
    expected_cost = sum(DEFAULT.cost_micro(p, o, c) for p, c, o in received)
    assert micro(costs) == expected_cost


def test_a_cancelled_stream_bills_the_tokens_it_was_sent(platform: Platform) -> None:
    tenant, key, _ = new_tenant(platform)
    client = openai.OpenAI(base_url=platform.base_url, api_key=key, max_retries=0)
    start = time.time()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a long story"}],
                                            max_tokens=3000, stream=True)
    request_id = stream.response.headers["x-request-id"]
    received = 0
    for _ in stream:
        received += 1
        if received == 8:
            break
    stream.close()  # the client goes away mid-stream
    # The tenant's event (tokens the engine made after the client left are the platform's, if any).
    [event] = [e for e in read_usage(platform, tenant, {request_id}, timeout=10) if e.billed_to == "tenant"]
    assert event.status == "cancelled"
    assert received - 1 <= event.usage.completion_tokens < 3000  # what was sent, not what was asked for

    page = wait_for(
        "the cancelled request's rollup",
        lambda: (p := usage_page(platform, key, start_time=int(start) - 60)) and totals(p)["requests"] == 1 and p,
    )
    assert totals(page)["output"] == event.usage.completion_tokens
    assert totals(page)["input"] == event.usage.prompt_tokens
    cost = micro(usage_page(platform, key, "/costs", start_time=int(start) - 60))
    assert cost == DEFAULT.cost_micro(
        event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens
    )


def test_budget_spend_equals_the_months_costs(platform: Platform) -> None:
    import redis.asyncio as aioredis

    from inferbus.stores.admission import Admission

    tenant, key, _ = new_tenant(platform, limits={"monthly_budget_usd": 50.0})
    client = openai.OpenAI(base_url=platform.base_url, api_key=key, max_retries=0)
    for i in range(6):
        ask(client, i, ("chat", "stream")[i % 2])
    now = time.time()
    month_start = calendar.timegm(dt.datetime.fromtimestamp(now, dt.timezone.utc).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0).timetuple())

    async def spend() -> int:
        redis = aioredis.from_url(platform.stack.redis_url)
        try:
            return round(await Admission(redis).spend_this_month(tenant) * 1_000_000)
        finally:
            await redis.aclose()

    def equal() -> bool:
        page = usage_page(platform, key, "/costs", start_time=month_start, bucket_width="1d", limit=31)
        return totals(usage_page(platform, key, start_time=month_start, limit=31))["requests"] == 6 and \
            micro(page) == asyncio.run(spend()) and micro(page) > 0

    wait_for("spend to equal /v1/costs", equal)


# ---- the usage API ----------------------------------------------------------------------------------

def test_usage_api_pages_isolation_and_errors(platform: Platform) -> None:
    a, key_a, _ = new_tenant(platform)
    b, key_b, _ = new_tenant(platform)
    now = time.time()
    hour = now - now % 3600
    events = synthetic(a, 30, hour - 5 * 3600) + synthetic(a, 30, hour - 2 * 3600) + synthetic(b, 5, hour - 3600)
    publish(platform, events)
    want_a, _ = expected(events[:60])
    wait_for("a's rollup", lambda: totals(usage_page(platform, key_a, start_time=int(hour - 86400)))["requests"] == 60)
    assert totals(usage_page(platform, key_a, start_time=int(hour - 86400))) == want_a  # b's usage is not a's
    assert totals(usage_page(platform, key_b, start_time=int(hour - 86400)))["requests"] == 5

    # 1h buckets, 2 per page: every bucket once, the same totals.
    pages, seen, cursor = 0, [], None
    while True:
        params: dict[str, Any] = {"start_time": int(hour - 6 * 3600), "end_time": int(hour + 1), "bucket_width": "1h",
                                  "limit": 2, "group_by": ["model", "api_key_id"]}
        if cursor:
            params["page"] = cursor
        page = usage_page(platform, key_a, **params)
        seen += page["data"]
        pages += 1
        cursor = page["next_page"]
        assert page["has_more"] == (cursor is not None)
        if not cursor:
            break
    assert pages == 4 and [b["start_time"] for b in seen] == [int(hour - 6 * 3600) + 3600 * i for i in range(7)]
    assert totals({"data": seen}) == want_a
    assert {r["api_key_id"] for b in seen for r in b["results"]} == {"key_0", "key_1", "key_2"}
    minutes = usage_page(platform, key_a, start_time=int(hour - 2 * 3600), end_time=int(hour - 2 * 3600 + 300),
                         bucket_width="1m", limit=5)
    assert totals(minutes)["requests"] == 30 and len(minutes["data"]) == 5

    bad = httpx.get(platform.base_url + "/usage", params={"start_time": 0, "bucket_width": "2h"},
                    headers={"authorization": f"Bearer {key_a}"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "bucket_width" and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(platform.base_url + "/costs", headers={"authorization": f"Bearer {key_a}"}).status_code == 400
    assert httpx.get(platform.base_url + "/usage", params={"start_time": 0}).status_code == 401
    # A tenant key is not an admin key, and tenants cannot pick another tenant.
    refused = httpx.get(platform.stack.gateway_url + "/admin/v1/usage", params={"start_time": 0},
                        headers={"authorization": f"Bearer {key_a}"})
    assert refused.status_code == 401
    assert httpx.get(platform.base_url + "/usage", params={"start_time": 0, "tenant": b},
                     headers={"authorization": f"Bearer {key_a}"}).status_code == 400

    admin = admin_get(platform, "/usage", start_time=int(hour - 86400), group_by="project_id", tenant=f"{a},{b}")
    # Summed over buckets: a's two hours land in different daily buckets when the run straddles midnight UTC.
    by_tenant: dict[str, int] = {}
    for bucket in admin["data"]:
        for result in bucket["results"]:
            by_tenant[result["project_id"]] = by_tenant.get(result["project_id"], 0) + result["num_model_requests"]
    assert by_tenant == {a: 60, b: 5}


def test_price_versions_apply_from_their_effective_time(platform: Platform) -> None:
    import redis.asyncio as aioredis

    from inferbus.stores.admission import Admission
    from inferbus.stores.billing import PriceStore

    tenant, _, _ = new_tenant(platform)
    model = "price-test-" + secrets.token_hex(3)  # prices of its own, nobody else's
    now = time.time()
    with platform.admin() as admin:
        past = admin.post("/prices", json={"model": model, "input": 2, "cached_input": 1, "output": 4,
                                           "effective": now - 10})
        assert past.status_code == 400 and past.json()["error"]["param"] == "effective"
        created = admin.post("/prices", json={"model": model, "input": 2, "cached_input": 1, "output": 4,
                                              "batch_discount": 0.25, "effective": now + 90})
        assert created.status_code == 201, created.text
        listed = admin.get("/prices").json()["data"]
    assert any(p["model"] == model and not p["in_force"] for p in listed)
    assert any(p["model"] == "*" and p["adapter"] == "*" and p["in_force"] for p in listed)  # seeded by billing

    before = synthetic(tenant, 20, now, model=model)
    after = synthetic(tenant, 20, now + 100, model=model)
    batch = synthetic(tenant, 20, now + 100, model=model, batch_id="batch_1")
    publish(platform, before + after + batch)

    async def book() -> PriceBook:
        redis = aioredis.from_url(platform.stack.redis_url)
        try:
            return (await PriceStore(redis, default=DEFAULT).load())[1]
        finally:
            await redis.aclose()

    prices = asyncio.run(book())
    assert prices.price_at(model, None, now + 100).input_per_mtok == 2
    _, cost_before = expected(before, prices)
    _, cost_after = expected(after + batch, prices)
    assert cost_before == expected(before)[1]  # the old (default) price for the earlier events
    assert cost_after > 2 * expected(after + batch)[1]  # about 3.3x: the new price, with 25% off batches
    wait_for("the rollup", lambda: tenant_totals(platform, tenant, now - 60, now + 200)["requests"] == 60)
    assert tenant_cost(platform, tenant, now - 60, now + 200) == cost_before + cost_after

    async def spend() -> int:
        redis = aioredis.from_url(platform.stack.redis_url)
        try:
            return round(await Admission(redis).spend_this_month(tenant) * 1_000_000)
        finally:
            await redis.aclose()

    # The reconciler prices with the same book: budgets see what /v1/costs says.
    wait_for("the reconciled spend", lambda: asyncio.run(spend()) == cost_before + cost_after)


def test_prices_cli_sets_and_lists_versions(platform: Platform) -> None:
    model = "cli-test-" + secrets.token_hex(3)
    admin = ["--url", platform.stack.gateway_url, "--admin-key", platform.admin_key]
    output = cli(platform, "prices", "set", "--model", model, "--adapter", "-", "--input", "1.25", "--cached-input",
                 "0.3", "--output", "2.5", *admin)
    assert model in output and "50% off batches" in output
    listed = cli(platform, "prices", "list", *admin)
    assert model in listed and "(base)" in listed
    too_soon = CliRunner().invoke(__import__("tools.commands.main", fromlist=["main"]).main,
                                  ["prices", "set", "--model", model, "--input", "1", "--cached-input", "1", "--output",
                                   "1", "--effective", "2020-01-01", *admin])
    assert too_soon.exit_code != 0 and "effective" in too_soon.output


# ---- faults -----------------------------------------------------------------------------------------

def test_killing_billing_mid_stream_loses_and_doubles_nothing(platform: Platform) -> None:
    tenant, _, _ = new_tenant(platform)
    now = time.time()
    events = synthetic(tenant, 3000, now - 1800)
    want, cost = expected(events)
    billing = platform.stack.get("billing")

    async def publish_and_kill() -> None:
        publisher = asyncio.create_task(_publish(platform.stack.nats_url, events, lambda e: e.request_id,
                                                 pause_every=100, pause_s=0.02))
        await asyncio.sleep(0.5)
        for _ in range(2):  # twice: the second kill lands while the restarted service catches up
            billing.signal(signal.SIGKILL)
            billing.wait(5)
            await asyncio.sleep(0.3)
            billing.start()
            await asyncio.sleep(1.5)
        await publisher

    asyncio.run(publish_and_kill())
    got = wait_for(
        "totals after the kills",
        lambda: (t := tenant_totals(platform, tenant, now - 3600, now)) and t["requests"] >= len(events) and t,
        timeout=30,
    )
    assert got == want
    assert tenant_cost(platform, tenant, now - 3600, now) == cost
    assert billing.alive()


def test_a_crash_between_writing_and_acking_counts_nothing_twice(platform: Platform) -> None:
    """A rollup consumer that wrote its batches to Redis and died before acking them: JetStream
    delivers them again (to the billing service), and the dedup sets keep them from counting twice."""
    import nats
    import redis.asyncio as aioredis

    from inferbus.stores.billing import PriceStore, UsageStore
    from services.billing.rollup import RollupConsumer

    tenant, _, _ = new_tenant(platform)
    now = time.time()
    events = synthetic(tenant, 400, now - 900)
    want, cost = expected(events)
    billing = platform.stack.get("billing")
    billing.signal(signal.SIGKILL)
    billing.wait(5)

    async def deliveries() -> tuple[int, int]:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            info = await nc.jetstream().consumer_info(subjects.USAGE_STREAM, "usage-rollup")
            return info.delivered.consumer_seq, info.delivered.stream_seq
        finally:
            await nc.close()

    async def write_without_acking() -> tuple[int, tuple[int, int]]:
        nc = await nats.connect(platform.stack.nats_url)
        redis = aioredis.from_url(platform.stack.redis_url)
        consumer = RollupConsumer(nc, platform.stack.nats_url, UsageStore(redis), PriceStore(redis, default=DEFAULT),
                                  batch=100, count_metrics=False, ack_wait_s=3)

        async def crash_before_ack(deliveries: Any, what: bytes = b"+ACK") -> None:
            return None  # the process "died" right after its Redis call

        consumer.connection.ack = crash_before_ack  # type: ignore[method-assign]
        await consumer.open()
        before = await deliveries()
        await _publish(platform.stack.nats_url, events, lambda e: e.request_id)
        try:
            await asyncio.wait_for(consumer.run(done=lambda: asyncio.sleep(0, consumer.counted >= len(events))), 20)
        finally:
            await consumer.stop()
            await redis.aclose()
            await nc.close()
        return consumer.counted, before

    counted, (consumer_before, stream_before) = asyncio.run(write_without_acking())
    assert counted == len(events)
    assert tenant_totals(platform, tenant, now - 3600, now) == want  # written, never acked
    billing.start()
    wait_for("the redeliveries to be rolled up", lambda: rollup_drained(platform), timeout=30)

    consumer_after, stream_after = asyncio.run(deliveries())
    # Consumer sequences count every delivery, stream sequences every event: each was delivered twice.
    assert (consumer_after - consumer_before) - (stream_after - stream_before) >= len(events)
    assert tenant_totals(platform, tenant, now - 3600, now) == want
    assert tenant_cost(platform, tenant, now - 3600, now) == cost


def test_duplicate_usage_events_are_counted_once(platform: Platform) -> None:
    tenant, _, _ = new_tenant(platform)
    now = time.time()
    events = synthetic(tenant, 300, now - 600)
    want, cost = expected(events)
    publish(platform, events)
    # The same request ids again under other message ids: new stream sequences, as a duplicate
    # published after JetStream's dedup window would be; one copy also claims another outcome.
    publish(platform, events, msg_id=lambda e: e.request_id + ".again")
    publish(platform, [m.UsageEvent(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "status": "failed"})
                       for e in events[:50]], msg_id=lambda e: e.request_id + ".third")
    wait_for("the ledger to be rolled up", lambda: rollup_drained(platform))
    assert tenant_totals(platform, tenant, now - 3600, now) == want
    assert tenant_cost(platform, tenant, now - 3600, now) == cost


def test_rebuilding_from_the_ledger_after_losing_the_rollups_gives_the_same_totals(platform: Platform) -> None:
    import redis as sync_redis

    tenant, _, _ = new_tenant(platform)
    now = time.time()
    publish(platform, synthetic(tenant, 500, now - 7200) + synthetic(tenant, 100, now - 120))
    wait_for("the ledger to be rolled up", lambda: rollup_drained(platform))
    start = now - 40 * 86400
    # Every query ends at the same moment: without an end the last bucket is "now", and a minute
    # or hour that begins between the two snapshots would add a bucket to one of them.
    end = int(now) + 1

    def snapshot() -> tuple[Any, ...]:
        everyone = admin_get(platform, "/usage", start_time=int(start), end_time=end, bucket_width="1d", limit=31,
                             group_by="tenant,model,api_key")
        costs = admin_get(platform, "/costs", start_time=int(start), end_time=end, bucket_width="1d", limit=31,
                          group_by="tenant,line_item")
        hours = admin_get(platform, "/usage", tenant=tenant, start_time=int(now - 3 * 3600), end_time=end,
                          bucket_width="1h", group_by="api_key,batch")
        minutes = admin_get(platform, "/usage", tenant=tenant, start_time=int(now - 300), end_time=end,
                            bucket_width="1m", limit=10)
        return everyone["data"], costs["data"], hours["data"], minutes["data"]

    before = snapshot()
    assert tenant_totals(platform, tenant, now - 3 * 3600, now)["requests"] == 600

    redis = sync_redis.Redis.from_url(platform.stack.redis_url)
    lost = list(redis.scan_iter(match="inferbus:{t:*}:usage:*", count=1000))
    assert lost
    redis.delete(*lost)  # every tenant's rollups and dedup sets: what a Redis without them would have
    assert tenant_totals(platform, tenant, now - 3 * 3600, now)["requests"] == 0

    output = cli(platform, "usage", "rebuild", "--yes")
    assert "Rebuilt usage rollups" in output
    assert snapshot() == before
    epoch = int(redis.get("inferbus:{billing}:epoch"))
    assert all(f":usage:{epoch}:".encode() in k for k in redis.scan_iter(match="inferbus:{t:*}:usage:*", count=1000))
    redis.close()
    # The service keeps rolling up into the new generation.
    later = synthetic(tenant, 10, now - 60)
    publish(platform, later)
    wait_for("new events after the rebuild",
             lambda: tenant_totals(platform, tenant, now - 3 * 3600, now)["requests"] == 610)


def test_last_months_export_is_written_once_per_tenant(platform: Platform, tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    from inferbus.stores.billing import UsageStore
    from services.billing.export import MonthlyExporter, month_range, previous_month

    tenant, _, _ = new_tenant(platform)
    # Two months back: the running service exports only last month, so this month is ours alone.
    month = previous_month(month_range(previous_month(time.time()))[0])
    start, _ = month_range(month)
    events = synthetic(tenant, 40, start + 3600) + synthetic(tenant, 10, start + 86400 * 3, batch_id="batch_x")
    want, cost = expected(events)
    publish(platform, events)
    wait_for("the ledger to be rolled up", lambda: rollup_drained(platform))

    by_hand = tmp_path / "by-hand"
    printed = cli(platform, "usage", "export-month", "--month", month, "--tenant", tenant, "--dir", str(by_hand))
    path = by_hand / month / f"{tenant}.csv"
    assert str(path) in printed
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert sum(int(r["input_tokens"]) for r in rows) == want["input"]
    assert sum(int(r["cost_micro_usd"]) for r in rows) == cost
    assert {r["batch_id"] for r in rows} == {"", "batch_x"}

    async def scheduled() -> tuple[list[Path], list[Path]]:
        redis = aioredis.from_url(platform.stack.redis_url)
        store = UsageStore(redis)
        clock = month_range(previous_month(time.time()))[0] + 3600  # an hour into the month after `month`

        async def caught_up() -> bool:
            return True

        exporter = MonthlyExporter(store, tmp_path / "scheduled", fmt="jsonl", width="1d", delay_s=1800,
                                   caught_up=caught_up, clock=lambda: clock)
        try:
            return await exporter.check(), await exporter.check()
        finally:
            await redis.aclose()

    first, second = asyncio.run(scheduled())
    assert tmp_path / "scheduled" / month / f"{tenant}.jsonl" in first
    assert second == []  # marked done: written once
