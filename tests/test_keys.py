"""API keys against a real Redis (started here on a free port)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from inferbus.local.ports import free_port
from inferbus.stores.keys import KEY_PREFIX, KeyStore, create_key, hash_secret

pytestmark = pytest.mark.slow


class CountingRedis(aioredis.Redis):
    gets = 0

    async def get(self, name):  # type: ignore[no-untyped-def, override]
        CountingRedis.gets += 1
        await asyncio.sleep(0.01)  # a slow Redis makes the burst overlap
        return await super().get(name)


async def test_keys_are_stored_hashed_and_resolve_to_their_tenant(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    secret = await create_key(client, "acme")
    assert await client.get(KEY_PREFIX + secret) is None  # never stored in the clear
    assert await client.exists(KEY_PREFIX + hash_secret(secret))
    store = KeyStore(client)
    principal = await store.lookup(secret)
    assert principal is not None and principal.tenant == "acme"
    assert await store.lookup("ib-not-a-key") is None
    await client.aclose()


async def test_a_burst_of_cold_lookups_makes_one_redis_call(redis_url: str) -> None:
    plain = aioredis.from_url(redis_url)
    secret = await create_key(plain, "burst")
    await plain.aclose()
    counting = CountingRedis.from_url(redis_url)
    store = KeyStore(counting)
    CountingRedis.gets = 0
    results = await asyncio.gather(*(store.lookup(secret) for _ in range(300)))
    assert {r.tenant for r in results if r} == {"burst"} and all(results)
    assert CountingRedis.gets == 1
    await counting.aclose()


async def test_redis_errors_reach_every_waiter(redis_url: str) -> None:
    dead = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    store = KeyStore(dead)
    results = await asyncio.gather(*(store.lookup("ib-x") for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, aioredis.RedisError) for r in results)
    await dead.aclose()
