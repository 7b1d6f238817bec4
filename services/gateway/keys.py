"""API keys: stored in Redis only as SHA-256 hashes, mapped to the tenant they belong to.

Lookups are cached in-process for a few seconds so that the hot path does not pay a Redis round
trip per request; a revoked key stops working within `cache_ttl_s`.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

KEY_PREFIX = "inferbus:apikey:"
SECRET_PREFIX = "ib-"


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str


class _Record(msgspec.Struct):
    tenant: str
    key_id: str
    created: float


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def create_key(redis: aioredis.Redis, tenant: str) -> str:
    """Create a key for `tenant`; the secret is returned once and never stored."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    record = _Record(tenant=tenant, key_id="key_" + secrets.token_hex(8), created=time.time())
    await redis.set(KEY_PREFIX + hash_secret(secret), msgspec.json.encode(record))
    return secret


class KeyStore:
    def __init__(self, redis: aioredis.Redis, cache_ttl_s: float = 10.0) -> None:
        self.redis = redis
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        # A burst of requests with a key not yet cached makes one Redis call, not one each.
        self._inflight: dict[str, asyncio.Future[Principal | None]] = {}

    async def lookup(self, secret: str) -> Principal | None:
        digest = hash_secret(secret)
        cached = self._cache.get(digest)
        if cached is not None and time.monotonic() - cached[0] < self.cache_ttl_s:
            return cached[1]
        pending = self._inflight.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
        self._inflight[digest] = future
        try:
            principal = await self._fetch(digest)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: waiters re-raise it, no "never retrieved" warning
            raise
        finally:
            del self._inflight[digest]
        future.set_result(principal)
        return principal

    async def _fetch(self, digest: str) -> Principal | None:
        raw = await self.redis.get(KEY_PREFIX + digest)
        principal = None
        if raw is not None:
            record = msgspec.json.decode(raw, type=_Record)
            principal = Principal(tenant=record.tenant, key_id=record.key_id)
        if len(self._cache) > 100_000:  # bounded: unknown keys must not grow memory forever
            self._cache.clear()
        self._cache[digest] = (time.monotonic(), principal)
        return principal
