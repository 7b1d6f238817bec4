"""A record that does not decode is a 404 or a skip for its tenant, logged and counted, never a
5xx or a dropped connection: junk written straight into the platform's KV buckets and Redis, then
read back through the HTTP API with the openai SDK."""

from __future__ import annotations

import asyncio
import io
import re
import secrets

import httpx
import nats
import openai
import pytest
import redis.asyncio as aioredis

from inferbus.bus import connection as bus
from inferbus.stores.batches import new_batch_id
from inferbus.stores.files import new_file_id
from inferbus.stores.keys import KEY_PREFIX, hash_secret, tenant_key
from proto import subjects

from .conftest import MODEL, Platform

pytestmark = pytest.mark.e2e

JUNK = b'{"type":"io.nats.jetstream.api.v1.account_info_response"}'  # what a deputy's reply looks like


def new_tenant(platform: Platform) -> tuple[str, openai.OpenAI]:
    """A fresh tenant (so listings hold only this test's objects) and an SDK client with its key."""
    tenant, key = platform.new_tenant()
    return tenant, platform.client(api_key=key, timeout=30)


def bad_records(platform: Platform) -> dict[str, float]:
    """`inferbus_bad_records_total` by store, from the gateway's /metrics."""
    text = httpx.get(platform.stack.gateway_url + "/metrics", timeout=10).text
    return {store: float(value) for store, value in
            re.findall(r'^inferbus_bad_records_total\{store="([a-z]+)"\} (\S+)$', text, re.MULTILINE)}


async def put_junk(platform: Platform, keys: dict[str, str]) -> None:
    """Write JUNK at each key of each bucket ({bucket: key}), as the operator (ops credentials)."""
    nc = await nats.connect(platform.stack.nats_url)
    try:
        js = nc.jetstream()
        for bucket, key in keys.items():
            await (await js.key_value(bucket)).put(key, JUNK)
    finally:
        await nc.close()


def test_undecodable_records_are_absent_for_their_tenant(platform: Platform) -> None:
    tenant, client = new_tenant(platform)
    good = client.files.create(file=("in.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    bad_file, bad_batch, bad_response = new_file_id(), new_batch_id(), "resp_" + secrets.token_hex(16)
    before = bad_records(platform)
    asyncio.run(put_junk(platform, {
        subjects.FILES_BUCKET: subjects.file_key(tenant, bad_file),
        subjects.BATCHES_BUCKET: subjects.batch_key(tenant, bad_batch),
        subjects.RESPONSES_BUCKET: subjects.response_key(tenant, bad_response),
    }))

    with pytest.raises(openai.NotFoundError) as missing_file:
        client.files.retrieve(bad_file)
    assert missing_file.value.status_code == 404
    assert missing_file.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.files.content(bad_file)
    assert [f.id for f in client.files.list()] == [good.id]  # the junk is skipped, the good file listed
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(bad_batch)
    assert list(client.batches.list()) == []
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(bad_response)

    after = bad_records(platform)
    for store in ("files", "batches", "responses"):
        assert after.get(store, 0) > before.get(store, 0), (store, before, after)


def test_an_undecodable_heartbeat_is_skipped_and_counted(platform: Platform) -> None:
    before = bad_records(platform).get("workers", 0)
    asyncio.run(put_junk(platform, {subjects.WORKERS_BUCKET: subjects.worker_key("junk-" + secrets.token_hex(4))}))
    deadline = asyncio.run(_wait_counted(platform, "workers", before))
    assert deadline, "the gateway did not count the junk heartbeat"
    reply = platform.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still served"}], max_tokens=3)
    assert reply.choices[0].message.content
    assert httpx.get(platform.stack.gateway_url + "/ready", timeout=10).json()["status"] == "ready"


async def _wait_counted(platform: Platform, store: str, before: float, timeout_s: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if (await asyncio.to_thread(bad_records, platform)).get(store, 0) > before:
            return True
        await asyncio.sleep(0.1)
    return False


async def _redis_set(platform: Platform, key: str, value: bytes) -> None:
    redis = aioredis.from_url(platform.stack.redis_url)
    try:
        await redis.set(key, value)
    finally:
        await redis.aclose()


def test_an_undecodable_api_key_record_is_an_unknown_key(platform: Platform) -> None:
    _, client = new_tenant(platform)
    client.models.list()  # served before the record is damaged
    asyncio.run(_redis_set(platform, KEY_PREFIX + hash_secret(client.api_key), JUNK))
    assert asyncio.run(_refused(client)), "the damaged key was still served"


def test_an_undecodable_tenant_record_refuses_its_keys_cleanly(platform: Platform) -> None:
    tenant, client = new_tenant(platform)
    client.models.list()  # served before the record is damaged

    async def damage() -> None:
        await _redis_set(platform, tenant_key(tenant, "tenant"), JUNK)

    asyncio.run(damage())
    # The gateway caches tenants for a moment; then the tenant is unknown: a 401, never a 5xx.
    loop_deadline = asyncio.run(_refused(client))
    assert loop_deadline, "the damaged tenant's key was still served"
    with platform.admin() as admin:
        listed = admin.get("/tenants")
        assert listed.status_code == 200 and tenant not in [t["id"] for t in listed.json()["data"]]


async def _refused(client: openai.OpenAI, timeout_s: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            await asyncio.to_thread(client.models.list)
        except openai.AuthenticationError:
            return True
        await asyncio.sleep(0.2)
    return False


async def test_ready_names_a_missing_ledger_stream_or_bucket(nc: nats.aio.client.Client) -> None:
    js = nc.jetstream()
    await bus.ensure_streams(js)
    await bus.workers_bucket(js, 3.0)
    await bus.batch_buckets(js)
    await js.create_key_value(bucket=subjects.RESPONSES_BUCKET)
    assert await bus.missing_stores(js) == []
    await js.delete_stream(subjects.USAGE_STREAM)
    await js.delete_key_value(subjects.FILES_BUCKET)
    assert await bus.missing_stores(js) == [f"stream:{subjects.USAGE_STREAM}", f"bucket:{subjects.FILES_BUCKET}"]


def test_the_gateway_is_not_ready_while_a_bucket_is_missing(platform: Platform) -> None:
    """The `responses` bucket deleted under the running gateway (and put back as it was)."""
    ready_url = platform.stack.gateway_url + "/ready"

    async def delete_then_restore() -> tuple[int, list[str], int]:
        nc = await nats.connect(platform.stack.nats_url)
        js = nc.jetstream()
        stream = f"KV_{subjects.RESPONSES_BUCKET}"
        config = (await js.stream_info(stream)).config
        await js.delete_stream(stream)
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                missing = await http.get(ready_url)
        finally:
            await js.add_stream(config)
            await nc.close()
        async with httpx.AsyncClient(timeout=10) as http:
            restored = await http.get(ready_url)
        return missing.status_code, missing.json()["problems"], restored.status_code

    status, problems, restored = asyncio.run(delete_then_restore())
    assert status == 503 and f"missing_bucket:{subjects.RESPONSES_BUCKET}" in problems, problems
    assert restored == 200
