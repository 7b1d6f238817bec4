"""Usage and costs for tenants (`GET /v1/usage`, `GET /v1/costs`), across tenants for operators
(`/admin/v1/usage`, `/admin/v1/costs`), and the price book (`/admin/v1/prices`).

The answers are read from the billing service's rollups in Redis and have the shape of OpenAI's
organisation usage and costs APIs: pages of time buckets (`1m`, `1h`, `1d`), each with one result
per group (`group_by` model, adapter, api_key_id, batch, ...), and a `next_page` cursor. A tenant's
API key sees only that tenant's usage. Parameters are validated by `inferbus.stores.usage`
(pure); bad ones are a 400 in the OpenAI error format naming the parameter.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferbus.openai import json_body
from inferbus.openai.errors import OpenAIError
from inferbus.runtime import logs
from inferbus.stores import usage as u
from inferbus.stores.billing import BillingState, PriceStore, UsageStore
from inferbus.stores.pricing import InvalidPrice, PriceVersion, effective_versions

from .admin import require_admin

log = logs.get(__name__)
_json = msgspec.json.Encoder()
# A price version must start at least this far in the future: every usage event accepted after it
# is priced by it, even if billing has not reloaded the book yet (clock skew between hosts included).
PRICE_LEAD_S = 60


def _respond(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _unavailable(error: Exception) -> OpenAIError:
    log.error("usage_storage_failed", error=repr(error))
    return OpenAIError(503, "Usage data (Redis) is unavailable; retry shortly.", code="service_unavailable",
                       headers={"retry-after": "1"})


async def answer(redis: aioredis.Redis, request: Request, kind: u.Kind, tenants: list[str] | None,
                 admin: bool = False) -> Response:
    """One page of usage or costs for `tenants` (None: every tenant with usage)."""
    try:
        state = BillingState(redis)
        epoch, _, minute_retention = await state.snapshot()
        query = u.parse_query(request.query_params.multi_items(), now=time.time(), kind=kind, admin=admin,
                              minute_retention_s=minute_retention)
        store = UsageStore(redis)
        buckets, next_page = await store.query(query, tenants if tenants is not None else (list(query.tenants) or None),
                                               epoch)
    except u.QueryError as error:
        raise OpenAIError(400, str(error), param=error.param, code="invalid_value") from None
    except aioredis.RedisError as error:
        raise _unavailable(error) from None
    shape = u.usage_results if kind == "usage" else u.cost_results
    return _respond(u.page_body([(start, shape(groups, query.group_by)) for start, groups in buckets], query.width,
                                next_page))


def _started(found: Any) -> Any:
    """`found`, or a 503 while the gateway is still starting (it is None until then)."""
    if found is None:
        raise OpenAIError(503, "The gateway is starting; retry shortly.", code="service_unavailable",
                          headers={"retry-after": "1"})
    return found


def usage_router(generation: Callable[[], Any], redis: Callable[[], aioredis.Redis | None]) -> APIRouter:
    """`/v1/usage` and `/v1/costs` for the tenant of the API key, authenticated like every other
    endpoint (`generation()` is the gateway's `Generation`, None while it starts)."""
    router = APIRouter()

    async def authenticate(request: Request) -> Any:
        return await _started(generation())._authenticate(request.headers.get("authorization"))

    def client() -> aioredis.Redis:
        return _started(redis())

    @router.get("/v1/usage")
    async def usage(request: Request) -> Response:
        principal = await authenticate(request)
        return await answer(client(), request, "usage", [principal.tenant])

    @router.get("/v1/costs")
    async def costs(request: Request) -> Response:
        principal = await authenticate(request)
        return await answer(client(), request, "costs", [principal.tenant])

    return router


def admin_usage_router(admin_key: str, redis: Callable[[], aioredis.Redis | None]) -> APIRouter:
    """Routes to mount at `/admin/v1`: usage and costs of any or every tenant, and the price book."""

    def client() -> aioredis.Redis:
        return _started(redis())

    router = APIRouter(dependencies=[Depends(require_admin(admin_key))])

    @router.get("/usage")
    async def usage(request: Request) -> Response:
        return await answer(client(), request, "usage", None, admin=True)

    @router.get("/costs")
    async def costs(request: Request) -> Response:
        return await answer(client(), request, "costs", None, admin=True)

    @router.get("/prices")
    async def list_prices(request: Request) -> Response:
        raw_at = request.query_params.get("at")
        try:
            at = time.time() if raw_at is None else float(raw_at)
        except ValueError:
            raise OpenAIError(400, "`at` must be a unix time in seconds.", param="at", code="invalid_value") from None
        try:
            _, book = await PriceStore(client()).load()
        except aioredis.RedisError as error:
            raise _unavailable(error) from None
        in_force = {v.field() for v in effective_versions(book, at)}
        data = [{"object": "price", **v.to_dict(), "in_force": v.field() in in_force} for v in book.versions]
        return _respond({"object": "list", "data": data, "at": at})

    @router.post("/prices")
    async def set_price(request: Request) -> Response:
        body = await json_body.read_json(request)
        if not isinstance(body, dict):
            raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
        now = time.time()
        body = dict(body)
        if body.get("effective") is None:
            body["effective"] = float(math.ceil((now + PRICE_LEAD_S) / 60) * 60)  # the next minute after the lead
        elif isinstance(body["effective"], str):
            try:
                body["effective"] = parse_time(body["effective"])
            except ValueError as error:
                raise OpenAIError(400, str(error), param="effective", code="invalid_value") from None
        body["created"] = now
        try:
            version = PriceVersion.from_dict(body)
        except InvalidPrice as error:
            raise OpenAIError(400, str(error), param=error.param, code="invalid_value") from None
        if version.effective < now + PRICE_LEAD_S:
            raise OpenAIError(400, f"A price version must take effect at least {PRICE_LEAD_S} s from now, so that "
                              "periods already billed keep their prices (and replaying the ledger reproduces them).",
                              param="effective", code="invalid_value")
        try:
            await PriceStore(client()).put(version)
        except aioredis.RedisError as error:
            raise _unavailable(error) from None
        log.info("price_set", model=version.model, adapter=version.adapter, effective=version.effective)
        return _respond({"object": "price", **version.to_dict(), "in_force": False}, 201)

    return router


def parse_time(text: str) -> float:
    """Unix seconds from an ISO 8601 time (UTC if no offset is given) or a number of seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not an ISO 8601 time or unix seconds: {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()
