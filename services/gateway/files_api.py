"""The Files API (`/v1/files`): upload, list, retrieve, download and delete a tenant's files.

Uploads are `multipart/form-data` with a `file` part and `purpose=batch`. The body is parsed as it
arrives and the file's bytes go straight to the file store (a temporary file renamed into place),
so a 200 MB upload never sits in memory and an upload over the limit is refused (413) as soon as
it passes it. Files are the tenant's own: another tenant's file id is a 404, like a missing one.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats.errors
from fastapi import APIRouter, Request
from prometheus_client import Counter
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from inferbus.openai.errors import OpenAIError
from inferbus.openai.objects import file_object, list_page
from inferbus.runtime import logs
from inferbus.stores.files import FileStore, FileTooLarge, Staging
from inferbus.stores.keys import Principal
from inferbus.stores.tenants import Tenant

log = logs.get(__name__)
_json = msgspec.json.Encoder()

FILES_UPLOADED = Counter("inferbus_files_uploaded_total", "Files uploaded through /v1/files")
FILES_UPLOADED_BYTES = Counter("inferbus_files_uploaded_bytes_total", "Bytes of files uploaded through /v1/files")
FILES_REJECTED = Counter("inferbus_files_upload_rejected_total", "Uploads refused", ["reason"])
FILES_DOWNLOADED_BYTES = Counter(
    "inferbus_files_downloaded_bytes_total", "Bytes of files sent by /v1/files/{id}/content"
)
FILES_DELETED = Counter("inferbus_files_deleted_total", "Files deleted through /v1/files")

UPLOAD_PURPOSES = ("batch",)  # what a tenant may upload; "batch_output" files are written by the batch service
MAX_FIELD_BYTES = 64 * 1024  # a form field other than the file (purpose): small
MAX_FILENAME_CHARS = 512
MULTIPART_SLACK = 64 * 1024  # part headers and boundaries around the file, for the Content-Length check
DOWNLOAD_CHUNK = 256 * 1024

Identity = Callable[[Request], Awaitable[tuple[Principal, Tenant]]]


def respond(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def started(found: Any) -> Any:
    """`found`, or a 503 while the gateway is still starting (it is None until then)."""
    if found is None:
        raise OpenAIError(503, "The gateway is starting; retry shortly.", code="service_unavailable",
                          headers={"retry-after": "1"})
    return found


F = TypeVar("F", bound=Callable[..., Awaitable[Response]])


def storage_errors(route: F) -> F:
    """Answer 503 (retry-after) when NATS (the KV records) or the file system fails, not a 500:
    both are transient for the client, who should retry."""

    @functools.wraps(route)
    async def guarded(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except (nats.errors.Error, asyncio.TimeoutError) as error:
            log.error("file_records_unavailable", error=repr(error))
            raise OpenAIError(503, "File and batch records (NATS) are unavailable; retry shortly.",
                              code="service_unavailable", headers={"retry-after": "1"}) from None
        except OSError as error:
            log.error("file_storage_failed", error=repr(error))
            raise OpenAIError(503, "File storage is unavailable; retry shortly.", code="storage_unavailable",
                              headers={"retry-after": "1"}) from None

    return guarded  # type: ignore[return-value]


def no_such_file(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


def bad_purpose(purpose: str) -> OpenAIError:
    return OpenAIError(400, f"Invalid purpose `{purpose}`: this server accepts uploads with purpose "
                       f"{', '.join(repr(p) for p in UPLOAD_PURPOSES)}.", param="purpose", code="invalid_value")


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OpenAIError(400, f"`{name}` must be an integer.", param=name, code="invalid_value") from None
    if not low <= value <= high:
        raise OpenAIError(400, f"`{name}` must be between {low} and {high}.", param=name, code="invalid_value")
    return value


class UploadForm:
    """Callbacks of python-multipart's streaming parser: the `file` part's bytes are queued for
    the staged file (written between parser calls, since writing is async), other parts are
    small text fields."""

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.pending: list[bytes] = []
        self._is_file = False
        self._name = ""
        self._data = bytearray()
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._part_begin, "on_part_data": self._part_data, "on_part_end": self._part_end,
            "on_header_field": self._header_field, "on_header_value": self._header_value_data,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
        }

    def take(self) -> list[bytes]:
        pending, self.pending = self.pending, []
        return pending

    def _part_begin(self) -> None:
        self._is_file, self._name, self._data, self._disposition = False, "", bytearray(), b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name, self._header_value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if self._name != "file":
            return
        if self.filename is not None:
            raise OpenAIError(400, "Send exactly one `file` part.", param="file", code="invalid_value")
        filename = options.get(b"filename", b"file").decode("utf-8", "replace") or "file"
        if len(filename) > MAX_FILENAME_CHARS:
            raise OpenAIError(400, f"The file name is longer than {MAX_FILENAME_CHARS} characters.", param="file",
                              code="invalid_value")
        purpose = self.fields.get("purpose")
        if purpose is not None and purpose not in UPLOAD_PURPOSES:
            raise bad_purpose(purpose)  # known before the bytes: refuse without reading them
        self.filename = filename
        self._is_file = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.pending.append(bytes(data[start:end]))
            return
        self._data += data[start:end]
        if len(self._data) > MAX_FIELD_BYTES:
            raise OpenAIError(400, f"The form field `{self._name}` is too large.", param=self._name or None,
                              code="invalid_value")

    def _part_end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._data.decode("utf-8", "replace").strip()


async def receive_upload(request: Request, staged: Staging) -> tuple[str, str]:
    """Parse the multipart body into `staged`; returns (filename, purpose), validated."""
    kind, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise OpenAIError(400, "Upload files as multipart/form-data with a `file` part and a `purpose` field.",
                          code="invalid_value")
    form = UploadForm()
    parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]  # a TypedDict in the stub
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for piece in form.take():
                await staged.write(piece)
        parser.finalize()
        for piece in form.take():
            await staged.write(piece)
    except FormParserError:
        raise OpenAIError(400, "The multipart body is malformed.", code="invalid_value") from None
    if parser.state != MultipartState.END:
        # The body ended before the closing boundary: the file may be cut anywhere, keep none of it.
        raise OpenAIError(400, "The multipart body ends before its closing boundary (a truncated upload).",
                          code="invalid_value")
    if form.filename is None:
        raise OpenAIError(400, "Missing the `file` part.", param="file", code="invalid_value")
    purpose = form.fields.get("purpose")
    if not purpose:
        raise OpenAIError(400, "Missing the `purpose` field.", param="purpose", code="invalid_value")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_purpose(purpose)
    if staged.size == 0:
        raise OpenAIError(400, "The file is empty.", param="file", code="invalid_value")
    return form.filename, purpose


def files_router(identity: Identity, files: Callable[[], FileStore | None]) -> APIRouter:
    """`/v1/files` for the tenant of the API key (`identity` authenticates a request; `files()`
    is the gateway's file store, None while it starts)."""
    router = APIRouter()

    @router.post("/v1/files")
    @storage_errors
    async def upload(request: Request) -> Response:
        _, tenant = await identity(request)
        store: FileStore = started(files())
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > store.max_bytes + MULTIPART_SLACK:
            FILES_REJECTED.labels("too_large").inc()
            raise _too_large(store.max_bytes)
        try:
            async with store.staging(tenant.id) as staged:
                filename, purpose = await receive_upload(request, staged)
                record = await staged.commit(filename, purpose)
        except FileTooLarge as error:
            FILES_REJECTED.labels("too_large").inc()
            raise _too_large(error.limit) from None
        except ClientDisconnect:  # nothing was kept; nobody is left to answer
            FILES_REJECTED.labels("disconnected").inc()
            raise OpenAIError(400, "The client disconnected during the upload.", code="client_disconnected") from None
        except OpenAIError:
            FILES_REJECTED.labels("invalid").inc()
            raise
        FILES_UPLOADED.inc()
        FILES_UPLOADED_BYTES.inc(record.bytes)
        log.info("file_uploaded", file_id=record.id, bytes=record.bytes, purpose=record.purpose)
        return respond(file_object(record))

    @router.get("/v1/files")
    @storage_errors
    async def list_files(request: Request) -> Response:
        _, tenant = await identity(request)
        store: FileStore = started(files())
        limit = int_param(request, "limit", 10_000, 1, 10_000)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise OpenAIError(400, "`order` must be `asc` or `desc`.", param="order", code="invalid_value")
        page, has_more = await store.list(tenant.id, purpose=request.query_params.get("purpose") or None,
                                          after=request.query_params.get("after") or None, limit=limit, order=order)
        data = [file_object(r) for r in page]
        return respond(list_page(data, has_more))

    @router.get("/v1/files/{file_id}")
    @storage_errors
    async def retrieve(file_id: str, request: Request) -> Response:
        _, tenant = await identity(request)
        record = await started(files()).get(tenant.id, file_id)
        if record is None:
            raise no_such_file(file_id)
        return respond(file_object(record))

    @router.get("/v1/files/{file_id}/content")
    @storage_errors
    async def content(file_id: str, request: Request) -> Response:
        _, tenant = await identity(request)
        store: FileStore = started(files())
        record = await store.get(tenant.id, file_id)
        if record is None:
            raise no_such_file(file_id)
        try:
            file = store.open(record)  # opened now: a delete while we stream does not cut the download
        except FileNotFoundError:
            log.error("file_bytes_missing", file_id=file_id)
            raise no_such_file(file_id) from None

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await asyncio.to_thread(file.read, DOWNLOAD_CHUNK):
                    FILES_DOWNLOADED_BYTES.inc(len(chunk))
                    yield chunk
            finally:
                file.close()

        ascii_name = record.filename.encode("ascii", "replace").decode().replace('"', "_")
        headers = {"content-length": str(record.bytes), "content-disposition": f'attachment; filename="{ascii_name}"'}
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    @router.delete("/v1/files/{file_id}")
    @storage_errors
    async def delete(file_id: str, request: Request) -> Response:
        _, tenant = await identity(request)
        if not await started(files()).delete(tenant.id, file_id):
            raise no_such_file(file_id)
        FILES_DELETED.inc()
        log.info("file_deleted", file_id=file_id)
        return respond({"id": file_id, "object": "file", "deleted": True})

    return router


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The file is larger than the limit of {limit} bytes ({limit / 1024 / 1024:g} MiB).",
                       param="file", code="file_too_large")
