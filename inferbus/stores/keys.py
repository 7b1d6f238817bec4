"""API keys: stored in Redis only as SHA-256 hashes, mapped to the tenant they belong to.

Two records per key:

- `inferbus:apikey:<sha256>` → {tenant, key_id, created}: the global lookup that authenticates a
  request (the gateway never knows the tenant before it has looked the key up);
- `inferbus:{t:<tenant>}:keys`, a hash key_id → {id, name, created, last4, hash}: the tenant's own
  list, under the tenant's hash tag, so keys can be listed and revoked without the secret;
- `inferbus:{t:<tenant>}:keys:used`, a hash key_id → when a gateway last authenticated a request
  with it (unix seconds, to `LAST_USED_PRECISION_S`: each gateway writes it at most once a minute
  per key, off the request's path).

Lookups are cached in-process for a few seconds so that the hot path does not pay a Redis round
trip per request; a revoked key stops working within `cache_ttl_s`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import redis.asyncio as aioredis

from inferbus.runtime.records import decode_or_none

KEY_PREFIX = "inferbus:apikey:"
SECRET_PREFIX = "ib-"
LAST_USED_PRECISION_S = 60.0

K = TypeVar("K")
V = TypeVar("V")


def tenant_key(tenant: str, part: str) -> str:
    """Redis key of a per-tenant record: one hash tag per tenant, so they share a Cluster slot."""
    return f"inferbus:{{t:{tenant}}}:{part}"


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str


class _Record(msgspec.Struct):
    tenant: str
    key_id: str
    created: float


class KeyInfo(msgspec.Struct, kw_only=True):
    """What an operator may see about a key: never the secret, nor its hash."""

    id: str
    name: str = ""
    created: float = 0.0
    last4: str = ""
    last_used: float | None = None  # None: never used (to within LAST_USED_PRECISION_S)


class _KeyMeta(msgspec.Struct, kw_only=True):
    id: str
    name: str = ""
    created: float = 0.0
    last4: str = ""
    hash: str


_record_decoder = msgspec.json.Decoder(_Record)
_meta_decoder = msgspec.json.Decoder(_KeyMeta)


class IssuedKey(msgspec.Struct, kw_only=True):
    """A key just created: the only time its secret exists outside the client."""

    id: str
    tenant: str
    name: str
    created: float
    secret: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def issue_key(redis: aioredis.Redis, tenant: str, name: str = "") -> IssuedKey:
    """Create a key for `tenant`; the secret is returned once and only its hash is stored."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    digest = hash_secret(secret)
    key_id = "key_" + secrets.token_hex(8)
    created = time.time()
    meta = _KeyMeta(id=key_id, name=name, created=created, last4=secret[-4:], hash=digest)
    # The tenant's list first: a crash in between leaves a listed key that does not work (and can
    # be revoked), never a working key that nobody can see.
    await redis.hset(tenant_key(tenant, "keys"), key_id, msgspec.json.encode(meta))
    await redis.set(KEY_PREFIX + digest, msgspec.json.encode(_Record(tenant=tenant, key_id=key_id, created=created)))
    return IssuedKey(id=key_id, tenant=tenant, name=name, created=created, secret=secret)


async def create_key(redis: aioredis.Redis, tenant: str, name: str = "") -> str:
    """Create a key for `tenant` and return its secret (see `issue_key` for the key's id too)."""
    return (await issue_key(redis, tenant, name)).secret


async def list_keys(redis: aioredis.Redis, tenant: str) -> list[KeyInfo]:
    """The tenant's keys, oldest first, with when each was last used."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(tenant_key(tenant, "keys"))
        pipe.hgetall(tenant_key(tenant, "keys:used"))
        raw, used_raw = await pipe.execute()
    used = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in used_raw.items()}
    decoded = [decode_or_none(_meta_decoder, value, store="keys", key=tenant_key(tenant, "keys"))
               for value in raw.values()]
    metas = [meta for meta in decoded if meta is not None]  # an undecodable one is skipped
    return [KeyInfo(id=m.id, name=m.name, created=m.created, last4=m.last4, last_used=used.get(m.id))
            for m in sorted(metas, key=lambda m: (m.created, m.id))]


async def record_use(redis: aioredis.Redis, tenant: str, key_id: str, when: float) -> None:
    """Note that `key_id` was used at `when` (never moving it back)."""
    field = tenant_key(tenant, "keys:used")
    previous = await redis.hget(field, key_id)
    if previous is None or float(previous) < when:
        await redis.hset(field, key_id, repr(when))


async def revoke_key(redis: aioredis.Redis, tenant: str, key_id: str) -> bool:
    """Revoke one key; False if the tenant has no such key. Cached lookups honour it until they expire."""
    raw = await redis.hget(tenant_key(tenant, "keys"), key_id)
    if raw is None:
        return False
    meta = msgspec.json.decode(raw, type=_KeyMeta)
    # Lookup record first: once it is gone the key is dead even if the second call fails.
    await redis.delete(KEY_PREFIX + meta.hash)
    await redis.hdel(tenant_key(tenant, "keys"), key_id)
    await redis.hdel(tenant_key(tenant, "keys:used"), key_id)
    return True


async def revoke_all_keys(redis: aioredis.Redis, tenant: str) -> int:
    """Revoke every key of `tenant`; returns how many there were."""
    raw = await redis.hgetall(tenant_key(tenant, "keys"))
    if raw:
        # One DEL per lookup record: they live in different Cluster slots.
        async with redis.pipeline(transaction=False) as pipe:
            for value in raw.values():
                pipe.delete(KEY_PREFIX + msgspec.json.decode(value, type=_KeyMeta).hash)
            await pipe.execute()
    await redis.delete(tenant_key(tenant, "keys"), tenant_key(tenant, "keys:used"))
    return len(raw)


class CachedLookup(Generic[K, V]):
    """An in-process cache whose entries expire after `ttl_s`.

    Concurrent misses for one key share one fetch (single flight): a burst of requests with a
    key not yet cached makes one Redis call, not one each. A failed fetch is not cached; every
    waiter gets its exception.
    """

    def __init__(self, ttl_s: float, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: dict[K, tuple[float, V]] = {}
        self._inflight: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, fetch: Callable[[K], Awaitable[V]]) -> V:
        cached = self._entries.get(key)
        if cached is not None and self.clock() - cached[0] < self.ttl_s:
            return cached[1]
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            value = await fetch(key)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: waiters re-raise it, no "never retrieved" warning
            raise
        finally:
            del self._inflight[key]
        self.put(key, value)
        future.set_result(value)
        return value

    def put(self, key: K, value: V) -> None:
        if len(self._entries) >= self.max_entries:  # bounded: unknown keys must not grow memory forever
            self._entries.clear()
        self._entries[key] = (self.clock(), value)

    def forget(self, key: K) -> None:
        self._entries.pop(key, None)


class KeyStore:
    def __init__(self, redis: aioredis.Redis, cache_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.time, cache_clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.cache_ttl_s = cache_ttl_s
        self.clock = clock  # wall time: when a key was last used
        self._cache: CachedLookup[str, Principal | None] = CachedLookup(cache_ttl_s, clock=cache_clock)
        self._used: dict[str, float] = {}  # key id → when this process last recorded its use
        self._recording: set[asyncio.Task[None]] = set()

    async def lookup(self, secret: str) -> Principal | None:
        principal = await self._cache.get(hash_secret(secret), self._fetch)
        if principal is not None:
            self._note_use(principal)
        return principal

    def forget(self, digest: str) -> None:
        """Drop a cached lookup (the key's SHA-256), e.g. at once after revoking it here."""
        self._cache.forget(digest)

    def _note_use(self, principal: Principal) -> None:
        """Record the key's use at most once per `LAST_USED_PRECISION_S` per process, off the
        request's path: a write that fails only leaves `last_used` a minute older."""
        now = self.clock()
        if now - self._used.get(principal.key_id, -math.inf) < LAST_USED_PRECISION_S:
            return
        if len(self._used) >= 100_000:  # bounded, like the lookup cache
            self._used.clear()
        self._used[principal.key_id] = now
        task = asyncio.ensure_future(self._record(principal, now))
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    async def _record(self, principal: Principal, now: float) -> None:
        try:
            await record_use(self.redis, principal.tenant, principal.key_id, now)
        except Exception:  # noqa: BLE001 - a lost note of use must never fail a request
            self._used.pop(principal.key_id, None)

    async def _fetch(self, digest: str) -> Principal | None:
        raw = await self.redis.get(KEY_PREFIX + digest)
        if raw is None:
            return None
        record = decode_or_none(_record_decoder, raw, store="keys", key=KEY_PREFIX + digest)
        if record is None:
            return None  # refused like an unknown key, never a 5xx
        return Principal(tenant=record.tenant, key_id=record.key_id)
