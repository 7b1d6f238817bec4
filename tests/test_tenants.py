"""Tenants and their API keys against a real Redis (started here on a free port)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis

from inferbus.stores.keys import KEY_PREFIX, KeyStore, hash_secret, issue_key, list_keys, revoke_key
from inferbus.stores.tenants import (
    InvalidTenant,
    Tenant,
    TenantExists,
    TenantLimits,
    TenantNotFound,
    TenantStore,
    may_use_model,
    tenant_from_dict,
    tenant_key,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


class CountingRedis(aioredis.Redis):
    gets = 0

    async def get(self, name):  # type: ignore[no-untyped-def, override]
        CountingRedis.gets += 1
        await asyncio.sleep(0.01)  # a slow Redis makes the burst overlap
        return await super().get(name)


async def test_crud_round_trip(redis: aioredis.Redis) -> None:
    store = TenantStore(redis)
    acme = await store.create(Tenant(id="acme", name="Acme", band="premium", weight=2,
                                     limits=TenantLimits(requests_per_minute=60, monthly_budget_usd=10.5)))
    assert acme.created > 0 and acme.updated == acme.created
    await store.create(Tenant(id="beta"))
    with pytest.raises(TenantExists):
        await store.create(Tenant(id="acme"))

    fresh = TenantStore(redis)  # another gateway: reads what the first one wrote
    got = await fresh.get("acme")
    assert got == acme and got.limits.requests_per_minute == 60 and got.models == ["*"]
    assert [t.id for t in await fresh.list()] == ["acme", "beta"]
    # Stored under the tenant's hash tag, as JSON without defaults.
    stored = msgspec.json.decode(await redis.get("inferbus:{t:acme}:tenant"))
    assert stored["band"] == "premium" and "disabled" not in stored

    updated = await store.update("acme", {"band": "standard", "limits": {"max_concurrent": 4}})
    assert updated.band == "standard" and updated.weight == 2.0
    assert updated.limits == TenantLimits(requests_per_minute=60, max_concurrent=4, monthly_budget_usd=10.5)
    assert updated.created == acme.created and updated.updated >= acme.updated
    # null lifts one limit, or resets a field to its default.
    lifted = await store.update("acme", {"limits": {"requests_per_minute": None}, "weight": None})
    assert lifted.limits.requests_per_minute is None and lifted.limits.max_concurrent == 4 and lifted.weight == 1.0
    with pytest.raises(TenantNotFound):
        await store.update("nobody", {"band": "premium"})

    assert await store.delete("beta") is True
    assert await store.delete("beta") is False
    assert await store.get("beta") is None and await fresh.fetch("beta") is None
    assert [t.id for t in await store.list()] == ["acme"]


@pytest.mark.parametrize(("data", "param"), [
    ({"id": "Acme"}, "id"),
    ({"id": "-acme"}, "id"),
    ({"id": "a" * 64}, "id"),
    ({"id": "acme\n"}, "id"),
    ({"name": "no id"}, "id"),
    ({"id": "acme", "band": "gold"}, "band"),
    ({"id": "acme", "weight": 0}, "weight"),
    ({"id": "acme", "weight": "heavy"}, "weight"),
    ({"id": "acme", "limits": {"requests_per_minute": 0}}, "limits.requests_per_minute"),
    ({"id": "acme", "limits": {"requests_per_minute": 1.5}}, "limits.requests_per_minute"),
    ({"id": "acme", "limits": {"monthly_budget_usd": -1}}, "limits.monthly_budget_usd"),
    ({"id": "acme", "limits": {"rpm": 10}}, "limits.rpm"),
    ({"id": "acme", "rpm": 10}, "rpm"),
    ({"id": "acme", "models": "llama"}, "models"),
    ({"id": "acme", "disabled": "yes"}, "disabled"),
])
def test_invalid_tenants_are_refused_naming_the_field(data: dict, param: str) -> None:
    with pytest.raises(InvalidTenant) as caught:
        tenant_from_dict(data)
    assert caught.value.param == param, str(caught.value)


async def test_store_validates_what_it_writes(redis: aioredis.Redis) -> None:
    store = TenantStore(redis)
    with pytest.raises(InvalidTenant):
        await store.create(Tenant(id="Not Valid"))  # constructing a Struct does not validate; the store does
    await store.create(Tenant(id="acme"))
    with pytest.raises(InvalidTenant) as caught:
        await store.update("acme", {"limits": {"max_concurrent": -3}})
    assert caught.value.param == "limits.max_concurrent"
    with pytest.raises(InvalidTenant):
        await store.update("acme", {"id": "other"})
    assert (await store.fetch("acme")) == (await store.get("acme"))  # nothing half-written
    assert await redis.scard("inferbus:tenants") == 1


async def test_get_is_cached_and_single_flight(redis_url: str, redis: aioredis.Redis) -> None:
    await TenantStore(redis).create(Tenant(id="acme"))
    counting = CountingRedis.from_url(redis_url)
    now = [1000.0]  # the cache's clock, moved by hand: a busy machine cannot stretch the window
    store = TenantStore(counting, cache_ttl_s=0.3, cache_clock=lambda: now[0])
    CountingRedis.gets = 0
    results = await asyncio.gather(*(store.get("acme") for _ in range(200)))
    assert all(r is not None and r.id == "acme" for r in results)
    assert CountingRedis.gets == 1
    assert await store.get("nobody") is None and await store.get("nobody") is None  # misses are cached too
    assert CountingRedis.gets == 2

    # A change made elsewhere shows once the entry expires; `fetch` always reads Redis.
    await TenantStore(redis).update("acme", {"disabled": True})
    assert (await store.get("acme")).disabled is False  # type: ignore[union-attr]
    assert (await store.fetch("acme")).disabled is True  # type: ignore[union-attr]
    await store.update("acme", {"disabled": False})  # this process's own writes are visible at once
    assert (await store.get("acme")).disabled is False  # type: ignore[union-attr]
    await TenantStore(redis).update("acme", {"band": "premium"})
    now[0] += 0.29
    assert (await store.get("acme")).band == "standard"  # type: ignore[union-attr]
    now[0] += 0.02
    assert (await store.get("acme")).band == "premium"  # type: ignore[union-attr]
    assert await store.get("../etc") is None  # never a Redis key built from a malformed id
    await counting.aclose()


async def test_concurrent_updates_of_different_fields_both_land(redis: aioredis.Redis) -> None:
    store = TenantStore(redis)
    await store.create(Tenant(id="acme"))
    changes = [{"limits": {field: 10}} for field in ("requests_per_minute", "input_tokens_per_minute",
                                                     "output_tokens_per_minute", "max_concurrent")]
    await asyncio.gather(*(TenantStore(redis).update("acme", c) for c in changes))
    limits = (await store.fetch("acme")).limits  # type: ignore[union-attr]
    assert (limits.requests_per_minute, limits.input_tokens_per_minute,
            limits.output_tokens_per_minute, limits.max_concurrent) == (10, 10, 10, 10)


async def test_keys_list_never_shows_secrets_and_revoke_works(redis: aioredis.Redis) -> None:
    first = await issue_key(redis, "acme", "laptop")
    second = await issue_key(redis, "acme")
    other = await issue_key(redis, "beta")
    listed = await list_keys(redis, "acme")
    assert [k.id for k in listed] == [first.id, second.id]
    assert listed[0].name == "laptop" and listed[0].last4 == first.secret[-4:]
    dumped = msgspec.json.encode(listed)
    for secret in (first.secret, second.secret):
        assert secret.encode() not in dumped and hash_secret(secret).encode() not in dumped
    # The tenant's key list sits under its hash tag, with the hash but never the secret.
    assert first.secret.encode() not in b"".join((await redis.hgetall(tenant_key("acme", "keys"))).values())

    keys = KeyStore(redis, cache_ttl_s=0)
    assert (await keys.lookup(first.secret)).key_id == first.id  # type: ignore[union-attr]
    assert await revoke_key(redis, "beta", first.id) is False  # not beta's key
    assert await revoke_key(redis, "acme", first.id) is True
    assert await revoke_key(redis, "acme", first.id) is False
    assert await keys.lookup(first.secret) is None
    assert await keys.lookup(second.secret) is not None
    assert [k.id for k in await list_keys(redis, "acme")] == [second.id]
    assert await keys.lookup(other.secret) is not None


async def test_a_revoked_key_works_until_the_cache_entry_expires(redis: aioredis.Redis) -> None:
    issued = await issue_key(redis, "acme")
    now = [1000.0]  # the cache's clock, moved by hand: a busy machine cannot stretch the window
    keys = KeyStore(redis, cache_ttl_s=0.2, cache_clock=lambda: now[0])
    assert await keys.lookup(issued.secret) is not None
    await revoke_key(redis, "acme", issued.id)
    now[0] += 0.19
    assert await keys.lookup(issued.secret) is not None  # the documented window
    now[0] += 0.02
    assert await keys.lookup(issued.secret) is None


async def test_deleting_a_tenant_revokes_all_its_keys(redis: aioredis.Redis) -> None:
    store = TenantStore(redis)
    await store.create(Tenant(id="acme"))
    await store.create(Tenant(id="beta"))
    doomed = [await issue_key(redis, "acme") for _ in range(3)]
    kept = await issue_key(redis, "beta")
    assert await store.delete("acme")
    keys = KeyStore(redis, cache_ttl_s=0)
    for issued in doomed:
        assert await keys.lookup(issued.secret) is None
        assert not await redis.exists(KEY_PREFIX + hash_secret(issued.secret))
    assert await list_keys(redis, "acme") == []
    assert await keys.lookup(kept.secret) is not None
    assert sorted(k.decode() for k in await redis.keys("*")) == sorted(
        ["inferbus:tenants", tenant_key("beta", "tenant"), tenant_key("beta", "keys"),
         KEY_PREFIX + hash_secret(kept.secret)])


def test_models_a_tenant_may_use() -> None:
    assert may_use_model(Tenant(id="a"), "any/model")
    only = Tenant(id="a", models=["llama-8b"])
    assert may_use_model(only, "llama-8b") and not may_use_model(only, "llama-70b")
    assert not TenantStore.may_use_model(Tenant(id="a", models=[]), "llama-8b")
