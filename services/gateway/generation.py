"""The two generation endpoints (`/v1/chat/completions`, `/v1/completions`) as plain ASGI.

These carry every token, so they bypass FastAPI's middleware stack and the per-response task
group of `StreamingResponse`: profiling put half of the gateway's CPU there. Frames already
queued are written to the socket together, which adds no latency and saves a write per token.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog

from inferbus import logs, tracing
from inferbus.prompt import LONG_TEXT_CHARS, PromptError, ServedModel, load_model, render_prompt
from inferbus.tokens import block_hashes
from proto import messages as m
from services.billing.pricing import Prices

from . import metrics, responses, schemas
from .admission import Admission, AdmissionUnavailable, Decision
from .dispatch import DispatchError, Dispatcher, Flight
from .errors import OpenAIError
from .keys import KeyStore, Principal
from .models import ModelCatalog
from .overload import OverloadPolicy
from .settings import GatewaySettings
from .tenants import Tenant, TenantStore

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.gateway")
_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# Engine priority per band (SGLang: larger runs first) so premium also wins inside an engine.
ENGINE_PRIORITY = {"premium": 10, "standard": 0}
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_JSON_HEADERS = [(b"content-type", b"application/json")]

Scope = dict[str, Any]


@dataclass
class _Call:
    """What a chat or completion call needs after parsing, whatever the endpoint."""

    endpoint: str
    object_id: str
    model: str
    created: int
    include_usage: bool
    stream: bool
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    flight: Flight | None = None
    usage: m.Usage | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # x-ratelimit-* for the response
    lease_held: bool = True  # the tenant's concurrency lease for this request

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"


class ClientGone(Exception):
    pass


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def send_json(send: Any, status: int, body: Any, request_id: str, headers: dict[str, str] | None = None) -> None:
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"x-request-id", request_id.encode()), *extra]})
    await send({"type": "http.response.body", "body": _json.encode(body)})


class Generation:
    def __init__(self, settings: GatewaySettings, dispatcher: Dispatcher, keys: KeyStore, tenants: TenantStore,
                 admission: Admission, overload: OverloadPolicy, prices: Prices,
                 catalog: ModelCatalog | None = None, served: ServedModel | None = None) -> None:
        self.settings = settings
        self.served = served or load_model(settings.model_dir)
        self.catalog = catalog or ModelCatalog(settings.model, int(time.time()))
        self.dispatcher = dispatcher
        self.keys = keys
        self.tenants = tenants
        self.admission = admission
        self.overload = overload
        self.prices = prices

    async def __call__(self, scope: Scope, receive: Any, send: Any, endpoint: str) -> None:
        request_id = uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            flight, call = await self._admit(scope, receive, request_id, endpoint)
        except OpenAIError as error:
            metrics.REQUESTS.labels(endpoint, str(error.status)).inc()
            await send_json(send, error.status, error.body(), request_id, error.headers)
            return
        except Exception:
            log.exception("unhandled_error")
            metrics.REQUESTS.labels(endpoint, "500").inc()
            error = OpenAIError(500, "The server had an error while processing your request.", code="internal_error")
            await send_json(send, 500, error.body(), request_id)
            return
        metrics.INFLIGHT.inc()
        status = "200"
        call.flight = flight
        try:
            if call.stream:
                status = await self._until_disconnect(receive, self._stream(flight, call, send, request_id))
            else:
                status = await self._until_disconnect(receive, self._respond(flight, call, send, request_id))
        except ClientGone:
            status = "499"
            metrics.ERRORS.labels("client_disconnect").inc()
            await self.dispatcher.cancel(flight, "client_disconnect")
        finally:
            await self._release_lease(call)
            self.dispatcher.close(flight)
            metrics.INFLIGHT.dec()
            metrics.REQUESTS.labels(endpoint, status).inc()
            if self.settings.access_log:
                self._access_log(call, status)

    def _access_log(self, call: _Call, status: str) -> None:
        flight = call.flight
        usage = call.usage
        log.info(
            "request", endpoint=call.endpoint, status=int(status), stream=call.stream,
            prompt_tokens=usage.prompt_tokens if usage else flight.prompt_tokens,
            completion_tokens=usage.completion_tokens if usage else flight.sent_tokens,
            cached_tokens=usage.cached_tokens if usage else None,
            ttft_ms=round((call.first_token_at - call.started) * 1000, 2) if call.first_token_at else None,
            duration_ms=round((time.monotonic() - call.started) * 1000, 2),
            attempts=flight.request.attempt + 1, worker=flight.worker_id,
        )

    # ---- admission: auth, parsing, publishing -----------------------------------------------

    async def _admit(self, scope: Scope, receive: Any, request_id: str, endpoint: str) -> tuple[Flight, _Call]:
        principal = await self._authenticate(_header(scope, b"authorization"))
        tenant = await self.tenant(principal)
        body = await self._read_body(receive, _header(scope, b"content-length"))
        if endpoint == "chat":
            chat = schemas.parse_chat(body)
            model, adapter = self.catalog.resolve(chat.model, tenant)
            render = functools.partial(render_prompt, self.served, messages=msgspec.to_builtins(chat.messages),
                                       tools=chat.tools)
            params: schemas._Common = chat
            object_id = f"chatcmpl-{request_id}"
        else:
            completion = schemas.parse_completion(body)
            model, adapter = self.catalog.resolve(completion.model, tenant)
            assert isinstance(completion.prompt, str)
            render = functools.partial(render_prompt, self.served, prompt=completion.prompt)
            params, object_id = completion, f"cmpl-{request_id}"
        try:
            # Rendered with the model's own template and tokenized once: the engine computes on
            # these ids, usage counts them and the router's prefix hashes are made from them. A long
            # prompt is tokenized in a thread (without the GIL) so other requests keep streaming.
            prompt = await asyncio.to_thread(render) if len(body) > LONG_TEXT_CHARS else render()
        except PromptError as error:
            raise OpenAIError(400, str(error), param="messages" if endpoint == "chat" else "prompt",
                              code="invalid_prompt") from None
        prompt_tokens = len(prompt.ids)
        hashes: list[int] = []
        if self.dispatcher.placement_timeout_s > 0:
            # The router places by prefix: the blocks of the ids the engine will cache.
            hashes = block_hashes(prompt.ids, self.settings.block_size, namespace=adapter or "")
        max_new_tokens = self._max_tokens(params.max_tokens, prompt_tokens)
        if not self.dispatcher.has_workers(model):
            raise OpenAIError(503, f"No workers are serving `{params.model}` right now; retry shortly.",
                              code="no_capacity", headers={"retry-after": "5"})
        # Platform overload before quotas: a request the platform sheds must not use up its quota.
        admitted, retry_after = self.overload.admit(tenant.band, self.dispatcher.held(tenant.band))
        if not admitted:
            raise OpenAIError(503, "The platform is overloaded; retry after the delay in `retry-after`.",
                              code="overloaded", headers={"retry-after": str(int(retry_after))})
        decision = await self._admission(tenant, request_id, prompt_tokens, max_new_tokens)
        now = time.time()
        inference = m.InferenceRequest(
            request_id=request_id, tenant=principal.tenant, model=model, prompt=prompt.text, kind=endpoint,  # type: ignore[arg-type]
            api_key_id=principal.key_id, adapter=adapter,
            tier=tenant.band, priority=ENGINE_PRIORITY.get(tenant.band, 0),
            sampling=m.SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=1.0 if params.temperature is None else params.temperature,
                top_p=1.0 if params.top_p is None else params.top_p,
                stop=schemas.stop_list(params.stop), seed=params.seed,
                presence_penalty=params.presence_penalty or 0.0, frequency_penalty=params.frequency_penalty or 0.0,
            ),
            reply_to=self.dispatcher.reply_subject(), deadline=now + self.settings.request_timeout_s,
            created=now, user=params.user, prompt_tokens=prompt_tokens, input_ids=prompt.ids,
        )
        call = _Call(endpoint=endpoint, object_id=object_id, model=params.model, created=int(now),
                     include_usage=bool(params.stream_options and params.stream_options.include_usage),
                     stream=params.stream,
                     headers=[(k.encode(), v.encode()) for k, v in decision.headers().items()])
        # Continue the client's trace if it sent `traceparent`; the context rides on to the engine.
        traceparent = _header(scope, b"traceparent")
        with tracing.span(tracer, f"gateway.{endpoint}", {"traceparent": traceparent} if traceparent else None):
            try:
                flight = await self.dispatcher.open(inference, weight=tenant.weight, block_hashes=hashes)
            except DispatchError as error:
                await self._release_reservation(tenant.id, request_id)
                raise OpenAIError(error.status, str(error), code=error.code,
                                  headers={"retry-after": str(int(error.retry_after or 1))}) from None
        return flight, call

    async def tenant(self, principal: Principal) -> Tenant:
        try:
            tenant = await self.tenants.get(principal.tenant)
        except aioredis.RedisError as error:
            log.error("tenant_lookup_failed", error=repr(error))
            raise OpenAIError(503, "Authentication is temporarily unavailable; retry shortly.",
                              code="auth_unavailable", headers={"retry-after": "1"}) from None
        if tenant is None:
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if tenant.disabled:
            raise OpenAIError(403, "This account is disabled.", code="account_disabled")
        return tenant

    async def _admission(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_new_tokens: int) -> Decision:
        estimate = self.prices.cost(prompt_tokens, max_new_tokens)
        try:
            decision = await self.admission.admit(tenant.id, tenant.limits, request_id, prompt_tokens,
                                                  max_new_tokens, estimate)
        except AdmissionUnavailable:
            raise OpenAIError(503, "Quota checks are temporarily unavailable; retry shortly.",
                              code="quota_unavailable", headers={"retry-after": "1"}) from None
        if decision.admitted:
            return decision
        if decision.reason == "budget":
            raise OpenAIError(429, "You exceeded your monthly budget; it renews at the start of next month.",
                              code="insufficient_quota", type="insufficient_quota", headers=decision.headers())
        what = {"requests": "requests per minute", "input_tokens": "input tokens per minute",
                "output_tokens": "output tokens per minute", "concurrency": "concurrent requests"}.get(decision.reason, decision.reason)
        raise OpenAIError(429, f"Rate limit reached for {what}; retry after the delay in `retry-after`.",
                          code="rate_limit_exceeded", type="rate_limit_error", headers=decision.headers())

    async def _release_lease(self, call: _Call) -> None:
        """Free the concurrency slot as the request ends; before its last bytes where possible, so
        a client that sends its next request at once is not refused."""
        if not call.lease_held or call.flight is None:
            return
        call.lease_held = False
        request = call.flight.request
        try:
            await self.admission.release(request.tenant, request.request_id)
        except Exception as error:  # the lease expires by itself; the ledger reconciles the rest
            log.warning("lease_release_failed", error=repr(error))

    async def _release_reservation(self, tenant_id: str, request_id: str) -> None:
        # Nothing ran: give the reservation back now instead of waiting for its lease to expire.
        try:
            await self.admission.reconcile(tenant_id, request_id, 0, 0, 0.0)
        except Exception as error:
            log.warning("reservation_release_failed", error=repr(error))

    async def _authenticate(self, header: str | None) -> Principal:
        scheme, _, secret = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise OpenAIError(401, "Missing API key: send `Authorization: Bearer <key>`.", code="missing_api_key")
        try:
            principal = await self.keys.lookup(secret.strip())
        except aioredis.RedisError as error:
            log.error("key_lookup_failed", error=repr(error))
            raise OpenAIError(503, "Authentication is temporarily unavailable; retry shortly.",
                              code="auth_unavailable", headers={"retry-after": "1"}) from None
        if principal is None:
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
        structlog.contextvars.bind_contextvars(tenant=principal.tenant)
        return principal

    async def _read_body(self, receive: Any, declared: str | None) -> bytes:
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"Request body too large: {declared} bytes, limit {limit}.", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise OpenAIError(400, "The client closed the connection before sending the body.", code="client_closed")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"Request body too large: over {limit} bytes.", code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def check_model(self, model: str, tenant: Tenant | None = None) -> None:
        self.catalog.resolve(model, tenant)

    def _max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        return responses.max_new_tokens(requested, prompt_tokens, self.settings.max_model_len,
                                        self.settings.default_max_tokens)

    # ---- relaying ---------------------------------------------------------------------------

    async def _until_disconnect(self, receive: Any, work: Any) -> str:
        """Run `work`; if the client disconnects first, cancel it and raise ClientGone."""
        current = asyncio.current_task()
        assert current is not None
        gone = False

        def on_disconnect(watch: asyncio.Future[None]) -> None:
            nonlocal gone
            if not watch.cancelled():
                gone = True
                current.cancel()

        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(on_disconnect)
        try:
            return await work
        except asyncio.CancelledError:
            if gone:
                current.uncancel()
                raise ClientGone from None
            raise
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()

    async def _stream(self, flight: Flight, call: _Call, send: Any, request_id: str) -> str:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, (b"x-request-id", request_id.encode()), *call.headers]})
        frames: list[bytes] = []
        first = True
        status = "200"
        try:
            async with asyncio.timeout(max(0.0, flight.request.deadline - time.time())):
                async for event in self.dispatcher.events(flight):
                    if isinstance(event, m.TokenChunk):
                        if event.text or first:
                            self._first_token(call, first)
                            frames.append(self._chunk(call, event.text, None, first))
                            first = False
                        if flight.events.empty():  # write what has queued up in one go
                            await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
                            frames.clear()
                        continue
                    if isinstance(event, m.Final):
                        if event.text or first:
                            self._first_token(call, first)
                            frames.append(self._chunk(call, event.text, None, first))
                        frames.append(self._chunk(call, None if call.endpoint == "chat" else "", _finish(event), False))
                        if call.include_usage:
                            frames.append(self._usage_chunk(call, event.usage))
                        self._record(flight, call, event)
                    else:
                        error = _event_error(event)
                        status = str(error.status)
                        frames.append(b"data: " + _json.encode(error.body()) + b"\n\n")
                        await self._give_up(flight, error)
                    break
        except TimeoutError:
            error = OpenAIError(504, "The request did not finish before its deadline.", code="timeout")
            status = "504"
            frames.append(b"data: " + _json.encode(error.body()) + b"\n\n")
            await self._give_up(flight, error, cancel_reason="deadline")
        await self._release_lease(call)
        frames.append(DONE)
        await send({"type": "http.response.body", "body": b"".join(frames), "more_body": False})
        return status

    async def _respond(self, flight: Flight, call: _Call, send: Any, request_id: str) -> str:
        parts: list[str] = []
        event: m.StreamEvent | None = None
        try:
            async with asyncio.timeout(max(0.0, flight.request.deadline - time.time())):
                async for event in self.dispatcher.events(flight):
                    if isinstance(event, m.TokenChunk):
                        parts.append(event.text)
                        continue
                    break
        except TimeoutError:
            error = OpenAIError(504, "The request did not finish before its deadline.", code="timeout")
            await self._give_up(flight, error, cancel_reason="deadline")
            await send_json(send, 504, error.body(), request_id)
            return "504"
        if not isinstance(event, m.Final):
            error = _event_error(event) if event is not None else OpenAIError(502, "No response from the worker.")
            await self._give_up(flight, error)
            await send_json(send, error.status, error.body(), request_id, error.headers)
            return str(error.status)
        parts.append(event.text)
        self._first_token(call, True)
        self._record(flight, call, event)
        await self._release_lease(call)
        await send_json(send, 200, self._completion_body(call, event, "".join(parts)), request_id,
                        {k.decode(): v.decode() for k, v in call.headers})
        return "200"

    # ---- rendering --------------------------------------------------------------------------

    def _chunk(self, call: _Call, text: str | None, finish: str | None, first: bool) -> bytes:
        if call.endpoint == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        chunk: dict[str, Any] = {"id": call.object_id, "object": call.chunk_object, "created": call.created,
                                 "model": call.model, "choices": [choice]}
        if call.include_usage:
            chunk["usage"] = None
        return b"data: " + _json.encode(chunk) + b"\n\n"

    def _usage_chunk(self, call: _Call, usage: m.Usage) -> bytes:
        chunk = {"id": call.object_id, "object": call.chunk_object, "created": call.created, "model": call.model,
                 "choices": [], "usage": _usage(usage)}
        return b"data: " + _json.encode(chunk) + b"\n\n"

    def _completion_body(self, call: _Call, final: m.Final, text: str) -> dict[str, Any]:
        return responses.completion_body(call.endpoint, call.object_id, call.created, call.model, text,
                                         final.finish_reason, final.usage)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _first_token(self, call: _Call, first: bool) -> None:
        if first and call.first_token_at is None:
            call.first_token_at = time.monotonic()
            metrics.TTFT.observe(call.first_token_at - call.started)

    def _record(self, flight: Flight, call: _Call, final: m.Final) -> None:
        call.usage = final.usage
        end = time.monotonic()
        metrics.E2E.observe(end - call.started)
        if call.first_token_at is not None and final.usage.completion_tokens > 1:
            metrics.TPOT.observe((end - call.first_token_at) / (final.usage.completion_tokens - 1))
        if flight.queue_wait is not None:
            metrics.QUEUE_WAIT.observe(flight.queue_wait)
        metrics.TOKENS.labels("prompt").inc(final.usage.prompt_tokens)
        metrics.TOKENS.labels("completion").inc(final.usage.completion_tokens)
        metrics.TOKENS.labels("cached").inc(final.usage.cached_tokens)

    async def _give_up(self, flight: Flight, error: OpenAIError, cancel_reason: str | None = None) -> None:
        metrics.ERRORS.labels(error.code or error.type).inc()
        if cancel_reason:
            await self.dispatcher.cancel(flight, cancel_reason)
        elif flight.worker_id is None:
            # No worker holds the request any more (it died and migration ran out): bill what was sent.
            await self.dispatcher.publish_usage(flight, "failed", "error")


_usage = responses.usage_body


def _finish(final: m.Final) -> str:
    return responses.finish_reason(final.finish_reason)


def _event_error(event: m.StreamEvent) -> OpenAIError:
    if isinstance(event, m.StreamError):
        status = event.status if event.status in (400, 404, 408, 413, 422, 429, 500, 502, 503, 504) else 500
        headers = {"retry-after": "1"} if status in (429, 503) else None
        return OpenAIError(status, event.message, code=event.code, headers=headers)
    return OpenAIError(503, "The request could not be completed; retry shortly.", code="worker_lost")


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
