"""The gateway's OpenAPI documents: the public API at `/openapi.json`, the admin API apart.

FastAPI lists the routes; the request bodies, query parameters and response bodies come from typed
models: the msgspec structs the endpoints decode with (`schemas.ChatCompletionRequest`,
`tenants.Tenant`, ...) and the structs below, which describe what the endpoints return. msgspec
writes their JSON schemas, so the document follows the code. The generation endpoints are plain
ASGI (see `generation.py`) and are added here. Admin routes (`/admin/...`) are left out of the
public document: tenants are not told they exist. The admin document is served behind the admin
key (`/admin/openapi.json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from msgspec import Meta

from inferbus.openai.schemas import ChatCompletionRequest, CompletionRequest
from inferbus.stores.tenants import Tenant, TenantLimits
from proto.bands import InteractiveBand

from .admin_adapters import BULK_LIMIT
from .responses_items import ResponsesRequest

ADMIN_PREFIX = "/admin"
_REF = "#/components/schemas/{name}"


# ---- what the endpoints return ----------------------------------------------------------------


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every 4xx and 5xx, in OpenAI's format."""

    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None


class TextCompletion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class FileObject(msgspec.Struct):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str


class FileList(msgspec.Struct):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(msgspec.Struct):
    id: str
    object: Literal["file"]
    deleted: bool


class FileUpload(msgspec.Struct):
    """`multipart/form-data`: the JSONL file and its purpose."""

    file: bytes
    purpose: Literal["batch"]


class RequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class Batch(msgspec.Struct):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(msgspec.Struct):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class CreateBatchRequest(msgspec.Struct):
    """The body of `POST /v1/batches` (checked by `batches_api.parse_create`)."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None


class UsagePage(msgspec.Struct):
    """A page of `/v1/usage` or `/v1/costs` buckets."""

    object: Literal["page"]
    data: list[dict[str, Any]]
    has_more: bool
    next_page: str | None


# ---- query parameters, as structs (field → one parameter) ---------------------------------------


class FileListQuery(msgspec.Struct):
    purpose: str | None = None
    after: str | None = None
    limit: int = 10_000
    order: Literal["asc", "desc"] = "desc"


class BatchListQuery(msgspec.Struct):
    after: str | None = None
    limit: int = 20


class UsageQuery(msgspec.Struct):
    start_time: int  # unix seconds, inclusive
    end_time: int | None = None
    bucket_width: Literal["1m", "1h", "1d"] = "1d"
    group_by: list[str] = []
    limit: int | None = None
    page: str | None = None
    models: list[str] = []
    api_key_ids: list[str] = []


class AdminUsageQuery(UsageQuery):
    tenant: list[str] = []
    tenants: list[str] = []


class TenantPatch(msgspec.Struct, omit_defaults=True):
    """`PATCH /admin/v1/tenants/{id}`: the fields to change."""

    name: str | None = None
    band: InteractiveBand | None = None
    weight: float | None = None
    limits: TenantLimits | None = None
    models: list[str] | None = None
    adapters: list[str] | None = None
    disabled: bool | None = None


class NewKey(msgspec.Struct):
    name: str = ""


class NewAdapter(msgspec.Struct):
    name: str
    version: str
    path: str
    base_model: str | None = None
    owner: str | None = None


class NewAdapters(msgspec.Struct):
    """`POST /admin/v1/adapters/bulk`: all are checked before any is registered."""

    adapters: Annotated[list[NewAdapter], Meta(min_length=1, max_length=BULK_LIMIT)]


# ---- the operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Operation:
    summary: str
    ok: type | None = None  # the JSON body of the success response (None: no schema)
    ok_status: int = 200
    ok_media: tuple[str, ...] = ("application/json",)
    body: type | None = None  # the JSON request body
    body_media: str = "application/json"
    query: type | None = None
    errors: tuple[int, ...] = (400, 401, 403, 404, 429, 503)
    public: bool = True  # False: no API key (health, readiness, metrics)
    plain_asgi: bool = False  # served by `Generation`, not a FastAPI route


_GENERATION_ERRORS = (400, 401, 403, 404, 413, 429, 500, 502, 503, 504)

PUBLIC: dict[tuple[str, str], Operation] = {
    ("post", "/v1/chat/completions"): Operation(
        "Create a chat completion (`stream: true` answers with server-sent events).",
        ChatCompletion,
        ok_media=("application/json", "text/event-stream"),
        body=ChatCompletionRequest,
        errors=_GENERATION_ERRORS,
        plain_asgi=True,
    ),
    ("post", "/v1/completions"): Operation(
        "Create a text completion (`stream: true` answers with server-sent events).",
        TextCompletion,
        ok_media=("application/json", "text/event-stream"),
        body=CompletionRequest,
        errors=_GENERATION_ERRORS,
        plain_asgi=True,
    ),
    ("post", "/v1/responses"): Operation(
        "Create a model response (`stream: true` answers with server-sent events).",
        ok_media=("application/json", "text/event-stream"),
        body=ResponsesRequest,
        errors=_GENERATION_ERRORS,
        plain_asgi=True,
    ),
    ("get", "/v1/responses/{response_id}"): Operation("Retrieve a stored response."),
    ("delete", "/v1/responses/{response_id}"): Operation("Delete a stored response."),
    ("get", "/v1/responses/{response_id}/input_items"): Operation("List a stored response's input items."),
    ("get", "/v1/models"): Operation("List the models this API key may use.", ModelList),
    ("get", "/v1/models/{model_id}"): Operation("Retrieve a model.", Model),
    ("post", "/v1/files"): Operation(
        "Upload a JSONL file for a batch.",
        FileObject,
        body=FileUpload,
        body_media="multipart/form-data",
        errors=(400, 401, 403, 413, 429, 503),
    ),
    ("get", "/v1/files"): Operation("List the tenant's files.", FileList, query=FileListQuery),
    ("get", "/v1/files/{file_id}"): Operation("Retrieve a file's metadata.", FileObject),
    ("get", "/v1/files/{file_id}/content"): Operation(
        "Download a file's bytes.", ok_media=("application/octet-stream",)
    ),
    ("delete", "/v1/files/{file_id}"): Operation("Delete a file.", FileDeleted),
    ("post", "/v1/batches"): Operation(
        "Create a batch from an uploaded file.",
        Batch,
        body=CreateBatchRequest,
        errors=(400, 401, 403, 404, 413, 429, 503),
    ),
    ("get", "/v1/batches"): Operation("List the tenant's batches.", BatchList, query=BatchListQuery),
    ("get", "/v1/batches/{batch_id}"): Operation("Retrieve a batch.", Batch),
    ("post", "/v1/batches/{batch_id}/cancel"): Operation(
        "Cancel a batch.", Batch, errors=(400, 401, 403, 404, 409, 429, 503)
    ),
    ("get", "/v1/usage"): Operation("The tenant's token usage, in time buckets.", UsagePage, query=UsageQuery),
    ("get", "/v1/costs"): Operation("The tenant's costs, in time buckets.", UsagePage, query=UsageQuery),
    ("get", "/health"): Operation("Liveness: the process answers.", public=False, errors=()),
    ("get", "/ready"): Operation("Readiness: NATS and Redis reachable (503 otherwise).", public=False, errors=(503,)),
    ("get", "/metrics"): Operation("Prometheus metrics.", ok_media=("text/plain",), public=False, errors=()),
}

ADMIN: dict[tuple[str, str], Operation] = {
    ("post", "/admin/v1/tenants"): Operation(
        "Create a tenant.", Tenant, ok_status=201, body=Tenant, errors=(400, 401, 409, 503)
    ),
    ("get", "/admin/v1/tenants"): Operation("List tenants."),
    ("get", "/admin/v1/tenants/{tenant_id}"): Operation("Retrieve a tenant.", Tenant),
    ("patch", "/admin/v1/tenants/{tenant_id}"): Operation("Change a tenant.", Tenant, body=TenantPatch),
    ("delete", "/admin/v1/tenants/{tenant_id}"): Operation("Delete a tenant and its keys."),
    ("post", "/admin/v1/tenants/{tenant_id}/keys"): Operation(
        "Issue an API key (its secret is shown once).", ok_status=201, body=NewKey
    ),
    ("get", "/admin/v1/tenants/{tenant_id}/keys"): Operation("List a tenant's API keys."),
    ("delete", "/admin/v1/tenants/{tenant_id}/keys/{key_id}"): Operation("Revoke an API key."),
    ("post", "/admin/v1/adapters"): Operation("Register a LoRA adapter.", ok_status=201, body=NewAdapter),
    ("post", "/admin/v1/adapters/bulk"): Operation(
        f"Register up to {BULK_LIMIT:,} LoRA adapters in one call (none if any is bad).",
        ok_status=201,
        body=NewAdapters,
    ),
    ("get", "/admin/v1/adapters"): Operation("List adapters."),
    ("get", "/admin/v1/adapters/{name}"): Operation("Retrieve an adapter."),
    ("delete", "/admin/v1/adapters/{name}"): Operation("Unregister an adapter."),
    ("get", "/admin/v1/usage"): Operation("Usage of any tenant.", UsagePage, query=AdminUsageQuery),
    ("get", "/admin/v1/costs"): Operation("Costs of any tenant.", UsagePage, query=AdminUsageQuery),
    ("get", "/admin/v1/prices"): Operation("The price list in force (`at`: unix seconds)."),
    ("post", "/admin/v1/prices"): Operation("Set prices from a time on."),
}

_STATUS_TEXT = {200: "OK", 201: "Created", 400: "Bad request", 401: "Missing or incorrect key",
                403: "Not allowed", 404: "Not found", 409: "Conflict", 413: "Body too large",
                429: "Rate limit or quota exceeded", 500: "Server error", 502: "Bad gateway",
                503: "Unavailable or overloaded (see retry-after)", 504: "Deadline passed"}


def public_document(api: FastAPI) -> dict[str, Any]:
    return _document(api, False, PUBLIC, "inferbus API", "API key of a tenant (`sk-...`).")


def admin_document(api: FastAPI) -> dict[str, Any]:
    return _document(api, True, ADMIN, "inferbus admin API", "The admin key (`INFERBUS_ADMIN_KEY`).")


def install(api: FastAPI) -> None:
    """Serve `public_document` as the app's `/openapi.json` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            api.openapi_schema = public_document(api)
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]


def _document(api: FastAPI, admin: bool, operations: dict[tuple[str, str], Operation],
              title: str, key_help: str) -> dict[str, Any]:
    doc = get_openapi(title=title, version=api.version, routes=api.routes)
    paths: dict[str, dict[str, Any]] = {path: item for path, item in doc.get("paths", {}).items()
                                        if path.startswith(ADMIN_PREFIX) == admin}
    doc["paths"] = paths
    models: set[type] = {ErrorResponse}
    for (method, path), op in operations.items():
        generated = paths.get(path, {}).get(method, {})
        if not generated and not op.plain_asgi:
            continue  # a route this app does not mount (no admin key, say): not documented
        paths.setdefault(path, {})[method] = _operation(op, generated, models, method, path)
    for path in list(paths):  # routes without a typed description keep FastAPI's, minus its 422
        for method, operation in paths[path].items():
            if (method, path) not in operations:
                operation.get("responses", {}).pop("422", None)
    _, components = msgspec.json.schema_components(sorted(models, key=lambda t: t.__name__), ref_template=_REF)
    doc["components"] = {"schemas": components,
                         "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": key_help}}}
    return doc


def _operation(op: Operation, generated: dict[str, Any], models: set[type], method: str, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": op.summary, "operationId": generated.get("operationId")
                           or f"{method}_{path.strip('/').replace('/', '_')}"}
    # Path parameters, and the query parameters of routes that declare them to FastAPI.
    parameters = [p for p in generated.get("parameters", []) if p.get("in") in ("path", "query")]
    if op.query is not None:
        parameters += _query_parameters(op.query)
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        models.add(op.body)
        schema = {"$ref": _REF.format(name=op.body.__name__)}
        if op.body_media == "multipart/form-data":
            schema = _multipart_schema(op.body)
        out["requestBody"] = {"required": True, "content": {op.body_media: {"schema": schema}}}
    responses: dict[str, Any] = {}
    ok: dict[str, Any] = {}
    for media in op.ok_media:
        if media == "application/json":
            if op.ok is not None:
                models.add(op.ok)
                ok[media] = {"schema": {"$ref": _REF.format(name=op.ok.__name__)}}
            else:
                ok[media] = {"schema": {"type": "object"}}
        elif media == "text/event-stream":
            ok[media] = {
                "schema": {"type": "string", "description": "`data: <chunk JSON>` events, then `data: [DONE]`"}
            }
        else:
            ok[media] = {"schema": {"type": "string"}}
    responses[str(op.ok_status)] = {"description": _STATUS_TEXT.get(op.ok_status, "OK"), "content": ok}
    for status in op.errors:
        responses[str(status)] = {"description": _STATUS_TEXT.get(status, "Error"), "content": {
            "application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}}
    out["responses"] = responses
    if op.public:
        out["security"] = [{"bearer": []}]
    return out


def _query_parameters(query: type) -> list[dict[str, Any]]:
    (schema,), components = msgspec.json.schema_components([query], ref_template=_REF)
    struct = components[schema["$ref"].rsplit("/", 1)[1]]
    required = set(struct.get("required", []))
    params = []
    for name, prop in struct["properties"].items():
        param: dict[str, Any] = {
            "name": name,
            "in": "query",
            "required": name in required,
            "schema": _nullable_to_plain(prop),
        }
        if prop.get("type") == "array":
            param.update(style="form", explode=True)
        params.append(param)
    return params


def _nullable_to_plain(prop: dict[str, Any]) -> dict[str, Any]:
    # A query parameter is absent rather than null: `int | None` is documented as the int.
    options = prop.get("anyOf")
    if options:
        kept = [o for o in options if o.get("type") != "null"]
        if len(kept) == 1:
            return {**kept[0], **({"default": prop["default"]} if prop.get("default") is not None else {})}
    return prop


def _multipart_schema(body: type) -> dict[str, Any]:
    (schema,), components = msgspec.json.schema_components([body], ref_template=_REF)
    struct = dict(components[schema["$ref"].rsplit("/", 1)[1]])
    properties = dict(struct["properties"])
    for name, prop in properties.items():
        if prop.get("contentEncoding") == "base64":  # bytes: in a form, the file part itself
            properties[name] = {"type": "string", "format": "binary"}
    struct["properties"] = properties
    return struct
