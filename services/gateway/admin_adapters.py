"""Admin API for LoRA adapters (`/admin/v1/adapters`), for operators and `inferbus adapters`.

    POST   /admin/v1/adapters          {name, version: "sha256:<64 hex>", path, base_model?, owner?}
    POST   /admin/v1/adapters/bulk     {adapters: [{name, version, path, base_model?, owner?}, ...]}
    GET    /admin/v1/adapters
    GET    /admin/v1/adapters/{name}
    DELETE /admin/v1/adapters/{name}

Re-registering a name with another version replaces it: workers load the new engine name on next
use, and the router's cache entries for the old one age out, because the version is part of the
name engines see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from nats.js import JetStreamContext
from starlette.responses import Response

from inferbus.openai.errors import OpenAIError
from inferbus.stores import adapters as registry
from proto import messages as m

from .admin import _body, _respond, require_admin

BULK_LIMIT = 1000  # adapters per bulk call: a body of ~300 KB


def adapter_body(spec: m.AdapterSpec) -> dict[str, Any]:
    body = msgspec.to_builtins(spec)
    body.pop("v", None)
    body["engine_name"] = spec.engine_name
    return body


def adapters_router(admin_key: str, base_model: str, jetstream: Callable[[], JetStreamContext | None]) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_admin(admin_key))])

    async def bucket():  # type: ignore[no-untyped-def]
        js = jetstream()
        if js is None:
            raise OpenAIError(503, "The gateway is starting; retry shortly.", code="service_unavailable",
                              headers={"retry-after": "1"})
        return await registry.bucket(js)

    def spec_from(body: Any, where: str = "") -> m.AdapterSpec:
        """A registration from one JSON object; `where` prefixes the offending field's name."""
        if not isinstance(body, dict):
            raise OpenAIError(
                400,
                f"{'`' + where.rstrip('.') + '`' if where else 'The request body'} must be a JSON object.",
                param=where.rstrip(".") or None,
                code="invalid_json",
            )
        for field in ("name", "version", "path"):
            if not isinstance(body.get(field), str) or not body[field]:
                raise OpenAIError(400, f"`{where}{field}` is required (a string).", param=where + field,
                                  code="invalid_value")
        model = body.get("base_model") or base_model
        if model != base_model:
            raise OpenAIError(400, f"This platform serves `{base_model}`; an adapter for `{model}` cannot run here.",
                              param=where + "base_model", code="invalid_value")
        owner = body.get("owner")
        if owner is not None and not isinstance(owner, str):
            raise OpenAIError(400, f"`{where}owner` must be a tenant id or null.", param=where + "owner",
                              code="invalid_value")
        try:
            spec = registry.new_spec(body["name"], model, body["version"], body["path"], owner)
        except registry.InvalidAdapter as error:
            param = "version" if "version" in str(error) else "name"
            raise OpenAIError(400, str(error), param=where + param, code="invalid_value") from None
        if spec.name == base_model:
            raise OpenAIError(400, "An adapter may not take the base model's name.", param=where + "name",
                              code="invalid_value")
        return spec

    @router.post("/adapters")
    async def register(request: Request) -> Response:
        spec = spec_from(await _body(request))
        await registry.put(await bucket(), spec)
        return _respond(adapter_body(spec), 201)

    @router.post("/adapters/bulk")
    async def register_many(request: Request) -> Response:
        """Register up to BULK_LIMIT adapters in one call: all are checked first, so a bad entry
        registers none of them (400 naming it, e.g. `adapters[3].version`)."""
        body = await _body(request)
        entries = body.get("adapters") if isinstance(body, dict) else None
        if not isinstance(entries, list) or not entries:
            raise OpenAIError(400, "`adapters` is required: a non-empty list of adapter objects.", param="adapters",
                              code="invalid_value")
        if len(entries) > BULK_LIMIT:
            raise OpenAIError(400, f"At most {BULK_LIMIT} adapters per call; send the rest in further calls.",
                              param="adapters", code="invalid_value")
        specs = [spec_from(entry, f"adapters[{i}].") for i, entry in enumerate(entries)]
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise OpenAIError(400, f"Adapter `{twice}` appears twice in one call.", param="adapters",
                              code="invalid_value")
        kv = await bucket()
        await asyncio.gather(*(registry.put(kv, spec) for spec in specs))
        return _respond({"object": "list", "data": [adapter_body(spec) for spec in specs]}, 201)

    @router.get("/adapters")
    async def list_adapters() -> Response:
        specs = await registry.list_all(await bucket())
        return _respond({"object": "list", "data": [adapter_body(spec) for spec in specs]})

    @router.get("/adapters/{name:path}")
    async def get_adapter(name: str) -> Response:
        spec = await registry.get(await bucket(), name)
        if spec is None:
            raise OpenAIError(404, f"Adapter `{name}` not found.", code="adapter_not_found")
        return _respond(adapter_body(spec))

    @router.delete("/adapters/{name:path}")
    async def delete_adapter(name: str) -> Response:
        if not await registry.delete(await bucket(), name):
            raise OpenAIError(404, f"Adapter `{name}` not found.", code="adapter_not_found")
        return _respond({"id": name, "object": "adapter", "deleted": True})

    return router
