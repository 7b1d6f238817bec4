"""`/v1/responses`: OpenAI's Responses API, run as the chat-completions request it translates to.

`POST /v1/responses` hands `Generation` the translated chat request (same admission, quotas,
priorities, placement, migration and billing) and turns what chat completions sends back into a
`response` object or the Responses stream's typed events (`responses_items`). Responses are
stored per tenant (`responses_store`) so that `previous_response_id`, `GET`, `DELETE` and the
input items listing work across gateway replicas and restarts.
"""

from __future__ import annotations

import functools
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import structlog
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from inferbus.openai.errors import OpenAIError
from inferbus.runtime import logs
from inferbus.stores.keys import Principal
from inferbus.stores.tenants import Tenant
from inferbus.tokens.prompt import LONG_TEXT_CHARS
from proto import messages as m

from . import metrics
from . import responses_items as items
from .generation import Generation, send_json
from .responses_store import ResponseStore, StoreUnavailable

log = logs.get(__name__)
_json = msgspec.json.Encoder()
_list_decoder = msgspec.json.Decoder(list[dict[str, Any]])
_dict_decoder = msgspec.json.Decoder(dict[str, Any])
Scope = dict[str, Any]


def _unavailable() -> OpenAIError:
    return OpenAIError(503, "Stored responses are unavailable right now; retry shortly.",
                       code="service_unavailable", headers={"retry-after": "1"})


class ResponsesAPI:
    def __init__(self, generation: Generation, store: ResponseStore) -> None:
        self.generation = generation
        self.store = store

    async def create(self, scope: Scope, receive: Any, send: Any) -> None:
        """`POST /v1/responses`."""
        local_id = uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=local_id)
        try:
            tenant, request, conversation, chat_body = await self._translate(scope, receive, local_id)
        except Exception as error:
            refusal = _refusal(error)
            metrics.RESPONSES.labels(str(refusal.status), "").inc()
            await send_json(send, refusal.status, refusal.body(), local_id, refusal.headers)
            return
        chat_scope = {**scope, "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "headers": [
            *((k, v) for k, v in scope["headers"] if k != b"content-length"),
            (b"content-length", str(len(chat_body)).encode())]}
        body_sent = False

        async def chat_receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": chat_body, "more_body": False}
            return await receive()  # the client's disconnect still reaches the chat path

        relay: _Relay = (_StreamRelay if request.stream else _WholeRelay)(self, send, tenant, request, conversation)
        await self.generation(chat_scope, chat_receive, relay, "chat")
        await relay.finish()
        metrics.RESPONSES.labels(str(relay.status), relay.response_status).inc()

    async def _translate(self, scope: Scope, receive: Any, local_id: str
                         ) -> tuple[str, items.ResponsesRequest, list[items.Item], bytes]:
        headers = dict(scope["headers"])
        principal = await self.generation._authenticate(_latin(headers.get(b"authorization")))
        tenant = await self.generation.tenant(principal)
        body = await self.generation._read_body(receive, _latin(headers.get(b"content-length")))
        parse = functools.partial(items.parse_request, body)
        # As the chat path does: a large body is decoded beside the event loop, not on it.
        request = await self.generation._off_loop(parse) if len(body) > LONG_TEXT_CHARS else parse()
        context: list[items.Item] = []
        if request.previous_response_id is not None:
            previous = await self.store.get(tenant.id, request.previous_response_id)
            if previous is None:
                raise OpenAIError(404, f"Previous response with id '{request.previous_response_id}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            context = _list_decoder.decode(previous.input_items) + _dict_decoder.decode(previous.response)["output"]
        conversation = context + items.input_items(request, local_id)
        items.check_call_outputs(conversation, len(context))
        if request.store and len(_json.encode(conversation)) > self.store.max_bytes:
            raise OpenAIError(400, f"The conversation is over the {self.store.max_bytes} bytes a stored response may "
                              "hold; start a new one, or send `store: false` with the whole input.",
                              param="input", code="conversation_too_large")
        chat = items.chat_request(request, items.chat_messages(request.instructions, conversation))
        return tenant.id, request, conversation, _json.encode(chat)

    async def save(self, tenant: str, response: dict[str, Any], conversation: list[items.Item]) -> None:
        """Store a finished response; if it cannot be stored, say so in its `store` field."""
        if not response["store"] or response["status"] not in ("completed", "incomplete"):
            return
        body, inputs = _json.encode(response), _json.encode(conversation)
        if not self.store.fits(body, inputs):
            log.warning("response_not_stored", response_id=response["id"], reason="too_large")
            metrics.RESPONSES_NOT_STORED.labels("too_large").inc()
            response["store"] = False
            return
        try:
            await self.store.put(m.StoredResponse(id=response["id"], tenant=tenant, created_at=response["created_at"],
                                                  response=body, input_items=inputs))
        except StoreUnavailable as error:  # the answer is still the client's; only a follow-up can't name it
            log.error("response_not_stored", response_id=response["id"], error=repr(error))
            metrics.RESPONSES_NOT_STORED.labels("store_unavailable").inc()
            response["store"] = False

    # ---- GET / DELETE ---------------------------------------------------------------------------

    async def stored(self, tenant: Tenant, response_id: str) -> m.StoredResponse:
        try:
            record = await self.store.get(tenant.id, response_id)
        except StoreUnavailable:
            raise _unavailable() from None
        if record is None:
            raise OpenAIError(
                404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
            )
        return record


def _refusal(error: Exception) -> OpenAIError:
    """The error a request that failed before generation gets."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, StoreUnavailable):
        log.error("responses_store_unavailable", error=str(error))
        return _unavailable()
    log.exception("unhandled_error")
    return OpenAIError(500, "The server had an error while processing your request.", code="internal_error")


def _latin(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


def _shell(request_id: str, request: items.ResponsesRequest) -> items.Shell:
    return items.Shell(id=f"resp_{request_id}", created_at=int(time.time()), model=request.model, request=request)


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    return next(v.decode() for k, v in headers if k == b"x-request-id")


class _Relay(ABC):
    """The `send` the chat path writes to; what reaches the client is the Responses form of it.
    Errors (anything but a 200) go through unchanged: they are the same errors."""

    def __init__(self, api: ResponsesAPI, send: Any, tenant: str, request: items.ResponsesRequest,
                 conversation: list[items.Item]) -> None:
        self.api = api
        self.send = send
        self.tenant = tenant
        self.request = request
        self.conversation = conversation
        self.passthrough = False
        self.status = 499  # until the chat path answers: the client left before it did
        self.response_status = ""  # the response object's, once there is one

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.passthrough = self.status != 200
        if self.passthrough:
            await self.send(_in_responses_terms(message))
        elif message["type"] == "http.response.start":
            await self.start(message)
        else:
            await self.body(message)

    @abstractmethod
    async def start(self, message: dict[str, Any]) -> None:
        """The chat path's 200 response start."""

    @abstractmethod
    async def body(self, message: dict[str, Any]) -> None:
        """A body message of the chat path's 200 response."""

    async def finish(self) -> None:  # noqa: B027 (an optional hook: the streaming relay owes nothing)
        """After the chat path returned: send what is still owed to the client."""


def _in_responses_terms(message: dict[str, Any]) -> dict[str, Any]:
    """An error body of the chat path, its `param` named as in the Responses request."""
    if message["type"] != "http.response.body":
        return message
    try:
        body = _dict_decoder.decode(message.get("body", b""))
        body["error"]["param"] = items.responses_param(body["error"].get("param"))
    except (msgspec.DecodeError, KeyError, TypeError):
        return message
    return {**message, "body": _json.encode(body)}


class _WholeRelay(_Relay):
    start_message: dict[str, Any] | None = None
    parts: list[bytes]

    async def start(self, message: dict[str, Any]) -> None:
        self.start_message, self.parts = message, []

    async def body(self, message: dict[str, Any]) -> None:
        self.parts.append(message.get("body", b""))

    async def finish(self) -> None:
        if self.passthrough or self.start_message is None:
            return
        headers = self.start_message["headers"]
        completion = _dict_decoder.decode(b"".join(self.parts))
        response = items.response_from_chat(_shell(_request_id(headers), self.request), completion)
        self.response_status = response["status"]
        await self.api.save(self.tenant, response, self.conversation)
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": _json.encode(response)})


class _StreamRelay(_Relay):
    translator: items.StreamTranslator
    pending = b""

    async def start(self, message: dict[str, Any]) -> None:
        self.translator = items.StreamTranslator(_shell(_request_id(message["headers"]), self.request))
        await self.send(message)
        await self.send({"type": "http.response.body", "body": b"".join(map(items.sse, self.translator.start())),
                         "more_body": True})

    async def body(self, message: dict[str, Any]) -> None:
        self.pending += message.get("body", b"")
        *frames, self.pending = self.pending.split(b"\n\n")
        events: list[items.Event] = []
        ended_before = self.translator.final is not None
        for frame in frames:
            if not frame.startswith(b"data: "):
                continue
            data = frame[len(b"data: "):]
            events += self.translator.end() if data == b"[DONE]" else self.translator.chunk(_dict_decoder.decode(data))
        final = self.translator.final
        if final is not None and not ended_before:
            self.response_status = final["status"]
            await self.api.save(self.tenant, final, self.conversation)  # before the client can name it
        more = message.get("more_body", False)
        if events or not more:
            await self.send({"type": "http.response.body", "body": b"".join(map(items.sse, events)), "more_body": more})


def responses_router(identity: Callable[[Request], Awaitable[tuple[Principal, Tenant]]],
                     api: Callable[[], ResponsesAPI | None]) -> APIRouter:
    router = APIRouter()

    def responses() -> ResponsesAPI:
        current = api()
        if current is None:
            raise OpenAIError(503, "The gateway is starting; retry shortly.", code="service_unavailable",
                              headers={"retry-after": "1"})
        return current

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request, stream: bool = False) -> Response:
        _, tenant = await identity(request)
        if stream:
            raise OpenAIError(400, "Replaying a stored response as a stream is not supported by this server.",
                              param="stream", code="unsupported_value")
        record = await responses().stored(tenant, response_id)
        return Response(record.response, media_type="application/json")

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        _, tenant = await identity(request)
        try:
            deleted = await responses().store.delete(tenant.id, response_id)
        except StoreUnavailable:
            raise _unavailable() from None
        if not deleted:
            raise OpenAIError(
                404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
            )
        return Response(_json.encode({"id": response_id, "object": "response", "deleted": True}),
                        media_type="application/json")

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, after: str | None = None,
                          limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc") -> Response:
        _, tenant = await identity(request)
        record = await responses().stored(tenant, response_id)
        data = _list_decoder.decode(record.input_items)
        if order == "desc":
            data.reverse()
        if after is not None:
            ids = [item["id"] for item in data]
            if after not in ids:
                raise OpenAIError(400, f"No input item with id '{after}' in this response.", param="after",
                                  code="invalid_value")
            data = data[ids.index(after) + 1:]
        page = data[:limit]
        return Response(_json.encode({
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit,
        }), media_type="application/json")

    return router
