"""Tenants: who may use the platform, in which priority band, with which limits and models.

One JSON record per tenant at `inferbus:{t:<tenant>}:tenant` (every per-tenant key shares the hash
tag `{t:<tenant>}`, so a tenant's records sit in one Redis Cluster slot and can be used together
in one script or transaction), and the set `inferbus:tenants` of ids for listing.

The gateway reads a tenant on every request, so `TenantStore.get` is cached in-process for a few
seconds; changes reach other gateway replicas within `cache_ttl_s`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import redis.asyncio as aioredis
from msgspec import Meta
from redis.exceptions import WatchError

from inferbus.runtime.records import decode_or_none
from inferbus.stores.keys import CachedLookup, revoke_all_keys, tenant_key
from proto.bands import InteractiveBand

__all__ = [
    "InteractiveBand",
    "InvalidTenant",
    "Tenant",
    "TenantExists",
    "TenantLimits",
    "TenantNotFound",
    "TenantStore",
    "TENANTS_SET",
    "apply_changes",
    "may_use_adapter",
    "may_use_model",
    "tenant_from_dict",
    "tenant_key",
    "valid_tenant_id",
]

TENANTS_SET = "inferbus:tenants"
TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
_TENANT_ID = re.compile(TENANT_ID_PATTERN)

_Rate = Annotated[int, Meta(ge=1)]
_Name = Annotated[str, Meta(max_length=200)]


class TenantLimits(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-tenant limits; None means unlimited."""

    requests_per_minute: _Rate | None = None
    input_tokens_per_minute: _Rate | None = None
    output_tokens_per_minute: _Rate | None = None
    max_concurrent: _Rate | None = None
    monthly_budget_usd: Annotated[float, Meta(ge=0.0)] | None = None


class Tenant(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: Annotated[str, Meta(pattern=TENANT_ID_PATTERN)]
    name: _Name = ""
    band: InteractiveBand = "standard"
    weight: Annotated[float, Meta(gt=0.0)] = 1.0  # fair-share weight within its band
    limits: TenantLimits = msgspec.field(default_factory=TenantLimits)
    models: list[_Name] = msgspec.field(default_factory=lambda: ["*"])  # "*" = every served model
    adapters: list[_Name] = msgspec.field(default_factory=list)  # its own and public ones
    disabled: bool = False
    created: float = 0.0
    updated: float = 0.0


class TenantExists(Exception):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"Tenant `{tenant_id}` already exists.")
        self.tenant_id = tenant_id


class TenantNotFound(Exception):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"Tenant `{tenant_id}` not found.")
        self.tenant_id = tenant_id


class InvalidTenant(ValueError):
    """A tenant field is missing or wrong; `param` names it (`limits.requests_per_minute`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_FIELDS = frozenset(Tenant.__struct_fields__)
_LIMIT_FIELDS = frozenset(TenantLimits.__struct_fields__)
_READ_ONLY = frozenset({"created", "updated"})
_PATH = re.compile(r"at `\$((?:\.\w+|\[\d+\])*)`")
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Tenant)


def valid_tenant_id(tenant_id: str) -> bool:
    return _TENANT_ID.fullmatch(tenant_id) is not None


def may_use_model(tenant: Tenant, model: str) -> bool:
    return "*" in tenant.models or model in tenant.models


def may_use_adapter(tenant: Tenant, name: str, owner: str | None) -> bool:
    """A private adapter: its owner only. A public one: named in the tenant's `adapters` (or `*`
    there), or allowed by its `models` (`*` is every served model, adapters included)."""
    if owner is not None:
        return owner == tenant.id
    return "*" in tenant.adapters or name in tenant.adapters or may_use_model(tenant, name)


def tenant_from_dict(data: Any) -> Tenant:
    """Validate a tenant given as JSON-like data (an API body); raises InvalidTenant.

    Unknown fields are refused, unlike on the OpenAI endpoints: a misspelt limit silently ignored
    would leave a tenant unlimited.
    """
    if not isinstance(data, dict):
        raise InvalidTenant("A tenant must be a JSON object.")
    for name in data:
        if name not in _FIELDS:
            raise InvalidTenant(f"Unknown tenant field `{name}`.", param=str(name))
    limits = data.get("limits")
    if isinstance(limits, dict):
        for name in limits:
            if name not in _LIMIT_FIELDS:
                raise InvalidTenant(f"Unknown limit `{name}`; known limits: {', '.join(sorted(_LIMIT_FIELDS))}.",
                                    param=f"limits.{name}")
    tenant_id = data.get("id")
    if tenant_id is None:
        raise InvalidTenant("Missing required field `id`.", param="id")
    if not isinstance(tenant_id, str) or not valid_tenant_id(tenant_id):
        raise InvalidTenant("A tenant id is 1 to 63 lowercase letters, digits and '-', "
                            "starting with a letter or digit.", param="id")
    try:
        return msgspec.convert(data, Tenant)
    except msgspec.ValidationError as error:
        match = _PATH.search(str(error))
        raise InvalidTenant(str(error), param=match.group(1).lstrip(".") or None if match else None) from None


def apply_changes(tenant: Tenant, changes: Any) -> Tenant:
    """`tenant` with a JSON merge patch (RFC 7396) applied: `null` resets a field to its default,
    `limits` merges field by field (so `{"limits": {"max_concurrent": null}}` lifts one limit)."""
    if not isinstance(changes, dict):
        raise InvalidTenant("Changes must be a JSON object.")
    if "id" in changes and changes["id"] != tenant.id:
        raise InvalidTenant("A tenant's id cannot be changed.", param="id")
    merged: dict[str, Any] = msgspec.to_builtins(tenant)
    for name, value in changes.items():
        if name in _READ_ONLY:
            continue
        if name == "limits" and isinstance(value, dict):
            merged["limits"] = {**merged.get("limits", {}), **value}
        elif value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return msgspec.structs.replace(tenant_from_dict(merged), created=tenant.created)


class TenantStore:
    def __init__(self, redis: aioredis.Redis, cache_ttl_s: float = 5.0,
                 cache_clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.cache_ttl_s = cache_ttl_s
        self._cache: CachedLookup[str, Tenant | None] = CachedLookup(cache_ttl_s, clock=cache_clock)

    may_use_model = staticmethod(may_use_model)

    async def create(self, tenant: Tenant) -> Tenant:
        """Store a new tenant (validated; `created`/`updated` set now). TenantExists if the id is taken."""
        now = time.time()
        tenant = msgspec.structs.replace(tenant_from_dict(msgspec.to_builtins(tenant)), created=now, updated=now)
        if not await self.redis.set(tenant_key(tenant.id, "tenant"), _encoder.encode(tenant), nx=True):
            raise TenantExists(tenant.id)
        await self.redis.sadd(TENANTS_SET, tenant.id)
        self._cache.put(tenant.id, tenant)
        return tenant

    async def get(self, tenant_id: str) -> Tenant | None:
        """The tenant, from the in-process cache if fetched less than `cache_ttl_s` ago (cheap per request)."""
        if not valid_tenant_id(tenant_id):
            return None
        return await self._cache.get(tenant_id, self._fetch)

    async def fetch(self, tenant_id: str) -> Tenant | None:
        """The tenant as Redis has it now (refreshing the cache): for operators, not the hot path."""
        if not valid_tenant_id(tenant_id):
            return None
        tenant = await self._fetch(tenant_id)
        self._cache.put(tenant_id, tenant)
        return tenant

    async def update(self, tenant_id: str, changes: dict[str, Any]) -> Tenant:
        """Apply a partial change (see `apply_changes`); TenantNotFound, InvalidTenant."""
        if not valid_tenant_id(tenant_id):
            raise TenantNotFound(tenant_id)
        key = tenant_key(tenant_id, "tenant")
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                # Optimistic: two concurrent updates of different fields must not lose either.
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise TenantNotFound(tenant_id)
                    current = decode_or_none(_decoder, raw, store="tenants", key=key)
                    if current is None:
                        raise TenantNotFound(tenant_id)
                    tenant = apply_changes(current, changes)
                    tenant = msgspec.structs.replace(tenant, updated=time.time())
                    pipe.multi()
                    pipe.set(key, _encoder.encode(tenant))
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        self._cache.put(tenant_id, tenant)
        return tenant

    async def delete(self, tenant_id: str) -> bool:
        """Delete the tenant and revoke all its keys; False if there was no such tenant."""
        if not valid_tenant_id(tenant_id):
            return False
        existed = await self.redis.delete(tenant_key(tenant_id, "tenant"))
        await revoke_all_keys(self.redis, tenant_id)
        await self.redis.srem(TENANTS_SET, tenant_id)
        self._cache.put(tenant_id, None)
        return bool(existed)

    async def list(self) -> list[Tenant]:
        """Every tenant, by id."""
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in await self.redis.smembers(TENANTS_SET))
        if not ids:
            return []
        # One GET each, pipelined: the records live in different Cluster slots, so no MGET.
        async with self.redis.pipeline(transaction=False) as pipe:
            for tenant_id in ids:
                pipe.get(tenant_key(tenant_id, "tenant"))
            raws = await pipe.execute()
        tenants = [decode_or_none(_decoder, raw, store="tenants", key=tenant_key(tenant_id, "tenant"))
                   for tenant_id, raw in zip(ids, raws) if raw is not None]
        return [tenant for tenant in tenants if tenant is not None]  # an undecodable one is skipped

    async def _fetch(self, tenant_id: str) -> Tenant | None:
        """The tenant, None if absent or if its record does not decode (then its keys are refused
        like an unknown tenant's, never a 5xx on every request)."""
        key = tenant_key(tenant_id, "tenant")
        raw = await self.redis.get(key)
        return decode_or_none(_decoder, raw, store="tenants", key=key) if raw is not None else None
