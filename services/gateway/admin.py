"""The admin API (`/admin/v1`): tenants and their API keys, for operators and `inferbus tenants|keys`.

It has its own credential, `INFERBUS_ADMIN_KEY`, separate from tenant keys: a tenant key gets 401
here. Without an admin key the router is not mounted at all, so every admin URL is a 404.
Errors use the OpenAI format, like the rest of the gateway.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferbus.openai import json_body
from inferbus.openai.errors import OpenAIError
from inferbus.runtime import logs
from inferbus.stores.keys import issue_key, list_keys, revoke_key
from inferbus.stores.tenants import (
    InvalidTenant,
    Tenant,
    TenantExists,
    TenantLimits,
    TenantNotFound,
    TenantStore,
    tenant_from_dict,
)

log = logs.get(__name__)
_json = msgspec.json.Encoder()
MAX_KEY_NAME = 100


def tenant_body(tenant: Tenant) -> dict[str, Any]:
    """A tenant with every field, defaults included (a null limit is unlimited)."""
    body = {name: getattr(tenant, name) for name in Tenant.__struct_fields__}
    body["limits"] = {name: getattr(tenant.limits, name) for name in TenantLimits.__struct_fields__}
    return body


def _respond(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _not_found(tenant_id: str) -> OpenAIError:
    return OpenAIError(404, f"Tenant `{tenant_id}` not found.", code="tenant_not_found")


async def _body(request: Request, required: bool = True) -> Any:
    limits = json_body.limits_of(request)
    raw = await json_body.read(request, limits)
    if not raw.strip():
        if required:
            raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
        return {}
    return json_body.decode(raw, limits)


@contextmanager
def _storage() -> Iterator[None]:
    """Redis trouble is a 503 the client may retry, not a 500."""
    try:
        yield
    except aioredis.RedisError as error:
        log.error("admin_storage_failed", error=repr(error))
        raise OpenAIError(503, "Tenant storage (Redis) is unavailable; retry shortly.",
                          code="service_unavailable", headers={"retry-after": "1"}) from None


def require_admin(admin_key: str) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency accepting only `Authorization: Bearer <admin_key>`."""

    async def authorize(request: Request) -> None:
        if not admin_key:  # mounted by mistake without a key: behave as if absent
            raise OpenAIError(404, f"Unknown endpoint: {request.method} {request.url.path}", code="unknown_url")
        scheme, _, secret = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise OpenAIError(401, "Missing admin key: send `Authorization: Bearer <INFERBUS_ADMIN_KEY>`.",
                              code="missing_api_key")
        if not hmac.compare_digest(secret.strip().encode(), admin_key.encode()):
            raise OpenAIError(401, "Incorrect admin key provided.", code="invalid_api_key")

    return authorize


def admin_router(admin_key: str, tenants: Callable[[], TenantStore | None]) -> APIRouter:
    """Routes to mount at `/admin/v1`; `tenants` returns the gateway's store (None before start-up)."""
    authorize = require_admin(admin_key)

    def store() -> TenantStore:
        found = tenants()
        if found is None:
            raise OpenAIError(503, "The gateway is starting; retry shortly.", code="service_unavailable",
                              headers={"retry-after": "1"})
        return found

    async def existing(tenant_id: str) -> TenantStore:
        s = store()
        if await s.fetch(tenant_id) is None:
            raise _not_found(tenant_id)
        return s

    router = APIRouter(dependencies=[Depends(authorize)])

    @router.post("/tenants")
    async def create_tenant(request: Request) -> Response:
        try:
            tenant = tenant_from_dict(await _body(request))
        except InvalidTenant as error:
            raise OpenAIError(400, str(error), param=error.param, code="invalid_value") from None
        with _storage():
            try:
                created = await store().create(tenant)
            except TenantExists as error:
                raise OpenAIError(409, str(error), param="id", code="tenant_exists") from None
        log.info("tenant_created", tenant=created.id)
        return _respond(tenant_body(created), 201)

    @router.get("/tenants")
    async def list_tenants() -> Response:
        with _storage():
            found = await store().list()
        return _respond({"object": "list", "data": [tenant_body(t) for t in found]})

    @router.get("/tenants/{tenant_id}")
    async def get_tenant(tenant_id: str) -> Response:
        with _storage():
            tenant = await store().fetch(tenant_id)
        if tenant is None:
            raise _not_found(tenant_id)
        return _respond(tenant_body(tenant))

    @router.patch("/tenants/{tenant_id}")
    async def update_tenant(tenant_id: str, request: Request) -> Response:
        changes = await _body(request)
        with _storage():
            try:
                tenant = await store().update(tenant_id, changes)
            except TenantNotFound:
                raise _not_found(tenant_id) from None
            except InvalidTenant as error:
                raise OpenAIError(400, str(error), param=error.param, code="invalid_value") from None
        log.info("tenant_updated", tenant=tenant_id, fields=sorted(changes) if isinstance(changes, dict) else None)
        return _respond(tenant_body(tenant))

    @router.delete("/tenants/{tenant_id}")
    async def delete_tenant(tenant_id: str) -> Response:
        with _storage():
            if not await store().delete(tenant_id):
                raise _not_found(tenant_id)
        log.info("tenant_deleted", tenant=tenant_id)
        return _respond({"id": tenant_id, "deleted": True})

    @router.post("/tenants/{tenant_id}/keys")
    async def create_key(tenant_id: str, request: Request) -> Response:
        body = await _body(request, required=False)
        if not isinstance(body, dict):
            raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
        for field in body:
            if field != "name":
                raise OpenAIError(400, f"Unknown key field `{field}`.", param=str(field), code="invalid_value")
        name = body.get("name") or ""
        if not isinstance(name, str) or len(name) > MAX_KEY_NAME:
            raise OpenAIError(400, f"`name` must be a string of at most {MAX_KEY_NAME} characters.",
                              param="name", code="invalid_value")
        with _storage():
            s = await existing(tenant_id)
            issued = await issue_key(s.redis, tenant_id, name)
        log.info("api_key_created", tenant=tenant_id, key_id=issued.id)
        return _respond({"id": issued.id, "tenant": tenant_id, "name": issued.name, "created": issued.created,
                         "secret": issued.secret}, 201)

    @router.get("/tenants/{tenant_id}/keys")
    async def get_keys(tenant_id: str) -> Response:
        with _storage():
            s = await existing(tenant_id)
            found = await list_keys(s.redis, tenant_id)
        return _respond({"object": "list", "data": [msgspec.to_builtins(k) for k in found]})

    @router.delete("/tenants/{tenant_id}/keys/{key_id}")
    async def delete_key(tenant_id: str, key_id: str) -> Response:
        with _storage():
            s = await existing(tenant_id)
            if not await revoke_key(s.redis, tenant_id, key_id):
                raise OpenAIError(404, f"Key `{key_id}` not found for tenant `{tenant_id}`.", code="key_not_found")
        log.info("api_key_revoked", tenant=tenant_id, key_id=key_id)
        return _respond({"id": key_id, "deleted": True})

    return router
