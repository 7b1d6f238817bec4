"""The Batch API (`/v1/batches`): create, retrieve, list and cancel a tenant's batches.

The gateway checks what it can answer at once (the input file is the caller's and has purpose
`batch`, the endpoint is one we serve, the completion window is 24h, metadata fits OpenAI's
limits) and writes the durable `BatchRecord` (status `validating`) to the `batches` KV bucket.
The batch service does the rest: it validates the file's lines, runs them and writes the output.
A cancel moves a validating or in-progress batch to `cancelling` (compare-and-set, so it never
overwrites the batch service's progress); the batch service finishes it as `cancelled`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from prometheus_client import Counter
from starlette.responses import Response

from inferbus.openai import json_body
from inferbus.openai.errors import OpenAIError
from inferbus.openai.objects import batch_object, list_page
from inferbus.runtime import logs
from inferbus.stores.batches import BatchStore, new_batch_id
from inferbus.stores.files import FileStore
from proto import messages as m

from .files_api import Identity, int_param, respond, started, storage_errors

log = logs.get(__name__)

BATCHES_CREATED = Counter("inferbus_batches_created_total", "Batches created through /v1/batches", ["endpoint"])
BATCHES_REJECTED = Counter("inferbus_batches_rejected_total", "Batch creations refused", ["param"])
BATCH_CANCELS = Counter("inferbus_batch_cancels_total", "Batch cancel requests by outcome "
                        "(cancelling: moved there now; unchanged: already cancelling or cancelled; refused: 409)",
                        ["outcome"])

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_CREATE_BODY_BYTES = 1024 * 1024
CANCELLABLE = frozenset({"validating", "in_progress"})


@dataclass(frozen=True)
class CreateBatch:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None


def _invalid(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def parse_create(body: Any) -> CreateBatch:
    """The fields of a `POST /v1/batches` body, checked; raises a 400 OpenAIError naming the
    parameter. Other fields (such as `output_expires_after`) are accepted and ignored."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str) or not body[name]:
            raise OpenAIError(
                400, f"Missing required parameter: `{name}`.", param=name, code="missing_required_parameter"
            )
    if body["endpoint"] not in BATCH_ENDPOINTS:
        raise _invalid(f"Unsupported endpoint `{body['endpoint']}`: batches may use "
                       f"{' or '.join(BATCH_ENDPOINTS)}.", "endpoint")
    if body["completion_window"] not in COMPLETION_WINDOWS:
        raise _invalid(f"Unsupported completion_window `{body['completion_window']}`: only "
                       f"{', '.join(COMPLETION_WINDOWS)} is supported.", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _invalid("`metadata` must be an object of string keys and values.", "metadata")
        if len(metadata) > MAX_METADATA_PAIRS:
            raise _invalid(f"`metadata` may have at most {MAX_METADATA_PAIRS} pairs.", "metadata")
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise _invalid(f"`metadata.{key}` must be a string.", "metadata")
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise _invalid(f"`metadata` keys may be at most {MAX_METADATA_KEY_CHARS} characters.", "metadata")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise _invalid(f"`metadata` values may be at most {MAX_METADATA_VALUE_CHARS} characters.", "metadata")
    return CreateBatch(body["input_file_id"], body["endpoint"], body["completion_window"], metadata or None)


def new_record(request: CreateBatch, tenant: str, api_key_id: str, now: float) -> m.BatchRecord:
    created = int(now)
    return m.BatchRecord(
        id=new_batch_id(), tenant=tenant, endpoint=request.endpoint, input_file_id=request.input_file_id,
        completion_window=request.completion_window, created_at=created,
        expires_at=created + COMPLETION_WINDOWS[request.completion_window], status="validating",
        api_key_id=api_key_id, metadata=request.metadata,
    )


class NotCancellable(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(f"Cannot cancel a batch with status '{status}'.")
        self.status = status


def cancel(record: m.BatchRecord, now: float) -> m.BatchRecord | None:
    """The record after a cancel request at `now`: `cancelling` from validating or in_progress;
    None (unchanged) when already cancelling or cancelled; NotCancellable when it has finished or
    is writing its output (finalizing), as OpenAI answers 409 there."""
    if record.status in CANCELLABLE:
        return msgspec.structs.replace(record, status="cancelling", cancelling_at=int(now))
    if record.status in ("cancelling", "cancelled"):
        return None
    raise NotCancellable(record.status)


def no_such_batch(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")


def batches_router(identity: Identity, batches: Callable[[], BatchStore | None],
                   files: Callable[[], FileStore | None], clock: Callable[[], float] = time.time) -> APIRouter:
    """`/v1/batches` for the tenant of the API key (`batches()`/`files()` are None while the
    gateway starts)."""
    router = APIRouter()

    @router.post("/v1/batches")
    @storage_errors
    async def create(request: Request) -> Response:
        principal, tenant = await identity(request)
        store: BatchStore = started(batches())
        file_store: FileStore = started(files())
        limits = json_body.limits_of(request)
        limits = replace(limits, max_bytes=min(limits.max_bytes, MAX_CREATE_BODY_BYTES))
        body = await json_body.read_json(request, limits=limits)
        try:
            parsed = parse_create(body)
            source = await file_store.get(tenant.id, parsed.input_file_id)
            if source is None:
                raise OpenAIError(404, f"No such File object: {parsed.input_file_id}", param="input_file_id",
                                  code="file_not_found")
            if source.purpose != "batch":
                raise _invalid(f"The input file must have purpose `batch`, not `{source.purpose}`.", "input_file_id")
        except OpenAIError as error:
            BATCHES_REJECTED.labels(error.param or "body").inc()
            raise
        record = new_record(parsed, tenant.id, principal.key_id, clock())
        await store.create(record)
        BATCHES_CREATED.labels(record.endpoint).inc()
        log.info("batch_created", batch_id=record.id, input_file_id=record.input_file_id, endpoint=record.endpoint)
        return respond(batch_object(record))

    @router.get("/v1/batches")
    @storage_errors
    async def list_batches(request: Request) -> Response:
        _, tenant = await identity(request)
        limit = int_param(request, "limit", 20, 1, 100)
        page, has_more = await started(batches()).list(tenant.id, after=request.query_params.get("after") or None,
                                                       limit=limit)
        data = [batch_object(r) for r in page]
        return respond(list_page(data, has_more))

    @router.get("/v1/batches/{batch_id}")
    @storage_errors
    async def retrieve(batch_id: str, request: Request) -> Response:
        _, tenant = await identity(request)
        record = await started(batches()).get(tenant.id, batch_id)
        if record is None:
            raise no_such_batch(batch_id)
        return respond(batch_object(record))

    @router.post("/v1/batches/{batch_id}/cancel")
    @storage_errors
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        _, tenant = await identity(request)
        store: BatchStore = started(batches())
        now = clock()
        changed = False

        def change(record: m.BatchRecord) -> m.BatchRecord | None:
            nonlocal changed
            after = cancel(record, now)
            changed = after is not None
            return after

        try:
            record = await store.update(tenant.id, batch_id, change)
        except NotCancellable as error:
            BATCH_CANCELS.labels("refused").inc()
            # OpenAI's answer, a 409 of type invalid_request_error; retrying cannot help.
            raise OpenAIError(
                409, str(error), type="invalid_request_error", headers={"x-should-retry": "false"}
            ) from None
        if record is None:
            raise no_such_batch(batch_id)
        BATCH_CANCELS.labels("cancelling" if changed else "unchanged").inc()
        if changed:
            log.info("batch_cancelling", batch_id=batch_id)
        return respond(batch_object(record))

    return router
