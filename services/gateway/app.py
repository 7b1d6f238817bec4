"""The OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from inferbus import bus, logs, tracing
from inferbus.prompt import render_chat
from inferbus.tokens import count_tokens
from proto import messages as m

from . import metrics, schemas
from .dispatch import DispatchError, Dispatcher, Flight
from .errors import (
    OpenAIError,
    http_exception_handler,
    openai_error_handler,
    unhandled_exception_handler,
    validation_exception_handler,
)
from .keys import KeyStore, Principal
from .settings import GatewaySettings

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.gateway")
_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class _Call:
    """What a chat or completion call needs after parsing, whatever the endpoint."""

    endpoint: str
    object_id: str
    model: str
    created: int
    include_usage: bool
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway_id = settings.resolved_gateway_id()
        self.started = int(time.time())
        self.dispatcher: Dispatcher | None = None
        self.keys: KeyStore | None = None
        self.redis: aioredis.Redis | None = None
        self.nc = None

    async def start(self) -> None:
        s = self.settings
        self.nc = await bus.connect(s.nats_url, name=f"gateway-{self.gateway_id}")
        js = self.nc.jetstream()
        await bus.ensure_streams(js)
        workers = await bus.workers_bucket(js, s.heartbeat_ttl_s)
        self.dispatcher = Dispatcher(
            self.nc, js, workers, gateway_id=self.gateway_id, heartbeat_ttl_s=s.heartbeat_ttl_s,
            max_attempts=s.max_attempts, placement_timeout_s=s.placement_timeout_ms / 1000,
        )
        await self.dispatcher.start()
        self.redis = aioredis.from_url(s.redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.keys = KeyStore(self.redis, s.key_cache_ttl_s)
        log.info("gateway_ready", gateway_id=self.gateway_id, host=s.host, port=s.port, model=s.model)

    async def stop(self) -> None:
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        if self.nc is not None:
            await self.nc.drain()
        if self.redis is not None:
            await self.redis.aclose()

    # ---- request handling -------------------------------------------------------------------

    async def authenticate(self, request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise OpenAIError(401, "Missing API key: send `Authorization: Bearer <key>`.", code="missing_api_key")
        assert self.keys is not None
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

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"Request body too large: {declared} bytes, limit {limit}.", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"Request body too large: over {limit} bytes.", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, model: str) -> None:
        if model != self.settings.model:
            raise OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                              param="model", code="model_not_found")

    def max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        room = self.settings.max_model_len - prompt_tokens
        if room < 1:
            raise OpenAIError(400, f"This model's maximum context length is {self.settings.max_model_len} tokens; "
                              f"your prompt has {prompt_tokens}.", param="messages", code="context_length_exceeded")
        if requested is None:
            return min(self.settings.default_max_tokens, room)
        if requested > room:
            raise OpenAIError(400, f"max_tokens is too large: {requested}. This model's maximum context length is "
                              f"{self.settings.max_model_len} tokens and your prompt has {prompt_tokens}.",
                              param="max_tokens", code="context_length_exceeded")
        return requested

    async def generate(self, request: Request, endpoint: str) -> Response:
        request_id = request.state.request_id
        principal = await self.authenticate(request)
        body = await self.read_body(request)
        if endpoint == "chat":
            chat = schemas.parse_chat(body)
            self.check_model(chat.model)
            prompt = render_chat(msgspec.to_builtins(chat.messages), chat.tools)
            params: schemas._Common = chat
            object_id = f"chatcmpl-{request_id}"
        else:
            completion = schemas.parse_completion(body)
            self.check_model(completion.model)
            assert isinstance(completion.prompt, str)
            prompt = completion.prompt
            params = completion
            object_id = f"cmpl-{request_id}"
        prompt_tokens = count_tokens(prompt)
        now = time.time()
        inference = m.InferenceRequest(
            request_id=request_id, tenant=principal.tenant, model=params.model, prompt=prompt, kind=endpoint,  # type: ignore[arg-type]
            sampling=m.SamplingParams(
                max_new_tokens=self.max_tokens(params.max_tokens, prompt_tokens),
                temperature=1.0 if params.temperature is None else params.temperature,
                top_p=1.0 if params.top_p is None else params.top_p,
                stop=schemas.stop_list(params.stop), seed=params.seed,
                presence_penalty=params.presence_penalty or 0.0, frequency_penalty=params.frequency_penalty or 0.0,
            ),
            reply_to="", deadline=now + self.settings.request_timeout_s, created=now, user=params.user,
            prompt_tokens=prompt_tokens,
        )
        assert self.dispatcher is not None
        inference.reply_to = self.dispatcher.reply_subject(request_id)
        if not self.dispatcher.has_workers(inference.model):
            raise OpenAIError(503, f"No workers are serving `{inference.model}` right now; retry shortly.",
                              code="no_capacity", headers={"retry-after": "5"})
        call = _Call(
            endpoint=endpoint, object_id=object_id, model=params.model, created=int(now),
            include_usage=bool(params.stream_options and params.stream_options.include_usage),
        )
        # Continue the client's trace if it sent `traceparent`; the context rides on to the engine.
        with tracer.start_as_current_span(f"gateway.{endpoint}", context=tracing.extract(request.headers)) as span:
            span.set_attribute("inferbus.request_id", request_id)
            try:
                flight = await self.dispatcher.open(inference)
            except DispatchError as error:
                raise OpenAIError(error.status, str(error), code=error.code,
                                  headers={"retry-after": str(int(error.retry_after or 1))}) from None
        metrics.INFLIGHT.inc()
        if params.stream:
            return StreamingResponse(self._sse(flight, call), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await self._collect(request, flight, call)

    # ---- streaming --------------------------------------------------------------------------

    def _chunk(self, call: _Call, text: str | None, finish: str | None, first: bool) -> bytes:
        if call.endpoint == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        chunk: dict[str, Any] = {"id": call.object_id, "object": obj, "created": call.created, "model": call.model,
                                 "choices": [choice]}
        if call.include_usage:
            chunk["usage"] = None
        return b"data: " + _json.encode(chunk) + b"\n\n"

    def _usage_chunk(self, call: _Call, usage: m.Usage) -> bytes:
        obj = "chat.completion.chunk" if call.endpoint == "chat" else "text_completion"
        chunk = {"id": call.object_id, "object": obj, "created": call.created, "model": call.model, "choices": [],
                 "usage": _usage(usage)}
        return b"data: " + _json.encode(chunk) + b"\n\n"

    async def _sse(self, flight: Flight, call: _Call) -> AsyncIterator[bytes]:
        assert self.dispatcher is not None
        outcome = "cancelled"
        first = True
        try:
            async with asyncio.timeout_at(self._deadline(flight)):
                async for event in self.dispatcher.events(flight):
                    if isinstance(event, m.TokenChunk):
                        if not event.text and not first:
                            continue
                        self._mark_first_token(call, first)
                        yield self._chunk(call, event.text, None, first)
                        first = False
                    elif isinstance(event, m.Final):
                        if event.text or first:
                            self._mark_first_token(call, first)
                            yield self._chunk(call, event.text, None, first)
                        yield self._chunk(call, None if call.endpoint == "chat" else "", _finish(event), False)
                        if call.include_usage:
                            yield self._usage_chunk(call, event.usage)
                        yield DONE
                        outcome = "ok"
                        self._record(flight, call, event)
                        return
                    else:
                        error = _event_error(event)
                        outcome = error.type
                        yield b"data: " + _json.encode(error.body()) + b"\n\n" + DONE
                        await self._give_up(flight, error)
                        return
        except TimeoutError:
            outcome = "timeout"
            error = OpenAIError(504, "The request did not finish before its deadline.", code="timeout")
            yield b"data: " + _json.encode(error.body()) + b"\n\n" + DONE
            await self._give_up(flight, error, cancel_reason="deadline")
        finally:
            if outcome == "cancelled":
                # The client went away: runs while this task is being cancelled, so do not await.
                asyncio.get_running_loop().create_task(self.dispatcher.cancel(flight, "client_disconnect"))
                metrics.ERRORS.labels("client_disconnect").inc()
            self._finish_flight(flight, call, "200" if outcome in ("ok", "cancelled") else outcome)

    async def _collect(self, request: Request, flight: Flight, call: _Call) -> Response:
        assert self.dispatcher is not None
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
        status = "200"
        try:
            collect = asyncio.ensure_future(self._gather(flight))
            done, _ = await asyncio.wait({collect, disconnected}, timeout=self._deadline(flight) - asyncio.get_running_loop().time(),
                                         return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:
                collect.cancel()
                if disconnected in done:
                    status = "499"
                    await self.dispatcher.cancel(flight, "client_disconnect")
                    metrics.ERRORS.labels("client_disconnect").inc()
                    return Response(status_code=499)
                error = OpenAIError(504, "The request did not finish before its deadline.", code="timeout")
                await self._give_up(flight, error, cancel_reason="deadline")
                status = "504"
                raise error
            event, text = collect.result()
            if not isinstance(event, m.Final):
                error = _event_error(event)
                await self._give_up(flight, error)
                status = str(error.status)
                raise error
            self._mark_first_token(call, True)
            self._record(flight, call, event)
            return Response(_json.encode(self._completion_body(call, event, text)), media_type="application/json")
        finally:
            disconnected.cancel()
            self._finish_flight(flight, call, status)

    async def _gather(self, flight: Flight) -> tuple[m.StreamEvent, str]:
        assert self.dispatcher is not None
        parts: list[str] = []
        async for event in self.dispatcher.events(flight):
            if isinstance(event, m.TokenChunk):
                parts.append(event.text)
                continue
            if isinstance(event, m.Final):
                parts.append(event.text)
            return event, "".join(parts)
        raise RuntimeError("event stream ended without a final event")

    def _completion_body(self, call: _Call, final: m.Final, text: str) -> dict[str, Any]:
        if call.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                      "logprobs": None, "finish_reason": _finish(final)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(final)}
            obj = "text_completion"
        return {"id": call.object_id, "object": obj, "created": call.created, "model": call.model,
                "choices": [choice], "usage": _usage(final.usage)}

    # ---- bookkeeping ------------------------------------------------------------------------

    def _deadline(self, flight: Flight) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + max(0.0, flight.request.deadline - time.time())

    def _mark_first_token(self, call: _Call, first: bool) -> None:
        if first and call.first_token_at is None:
            call.first_token_at = time.monotonic()
            metrics.TTFT.observe(call.first_token_at - call.started)

    def _record(self, flight: Flight, call: _Call, final: m.Final) -> None:
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
        assert self.dispatcher is not None
        metrics.ERRORS.labels(error.code or error.type).inc()
        if cancel_reason:
            await self.dispatcher.cancel(flight, cancel_reason)
        elif flight.worker_id is None:
            # No worker holds the request any more (it died and migration ran out): bill what was sent.
            await self.dispatcher.publish_usage(flight, "failed", "error")

    def _finish_flight(self, flight: Flight, call: _Call, status: str) -> None:
        assert self.dispatcher is not None
        self.dispatcher.close(flight)
        metrics.INFLIGHT.dec()
        metrics.REQUESTS.labels(call.endpoint, status).inc()


def _usage(usage: m.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _finish(final: m.Final) -> str:
    return "length" if final.finish_reason == "length" else "stop"


def _event_error(event: m.StreamEvent) -> OpenAIError:
    if isinstance(event, m.StreamError):
        status = event.status if event.status in (400, 404, 408, 413, 422, 429, 500, 502, 503, 504) else 500
        headers = {"retry-after": "1"} if status in (429, 503) else None
        return OpenAIError(status, event.message, code=event.code, headers=headers)
    return OpenAIError(503, "The request could not be completed; retry shortly.", code="worker_lost")


class RequestIdMiddleware:
    """Give every HTTP request an id (`x-request-id`, the SDK's `request_id`) and bind it to logs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message["headers"] = [*headers, header]
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(settings: GatewaySettings) -> FastAPI:
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="inferbus gateway", version="0.1.0", lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)
    app.state.gateway = gateway
    app.add_exception_handler(OpenAIError, openai_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(Exception, unhandled_exception_handler)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.generate(request, "completion")

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        await gateway.authenticate(request)
        data = [{"id": settings.model, "object": "model", "created": gateway.started, "owned_by": "inferbus"}]
        return Response(_json.encode({"object": "list", "data": data}), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        await gateway.authenticate(request)
        gateway.check_model(model_id)
        body = {"id": settings.model, "object": "model", "created": gateway.started, "owned_by": "inferbus"}
        return Response(_json.encode(body), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/ready")
    async def ready() -> Response:
        problems = []
        if gateway.nc is None or not gateway.nc.is_connected:
            problems.append("nats")
        try:
            assert gateway.redis is not None
            await gateway.redis.ping()
        except Exception:
            problems.append("redis")
        # Workers are not a readiness condition: without them this replica still answers 503s.
        workers = len(gateway.dispatcher.live_workers) if gateway.dispatcher else 0
        body = {"status": "ready" if not problems else "not_ready", "problems": problems, "workers": workers}
        return Response(_json.encode(body), status_code=200 if not problems else 503, media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(settings: GatewaySettings) -> None:
    import uvicorn

    logs.configure("gateway", settings.log_level)
    tracing.configure("gateway", settings.otel_exporter)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, loop="uvloop", http="httptools",
        access_log=False, log_level="warning", timeout_graceful_shutdown=10,
    )
