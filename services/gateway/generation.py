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
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
import structlog

from inferbus.openai import carry, json_body, responses, schemas
from inferbus.openai.errors import OpenAIError
from inferbus.openai.sampling import answer_schema
from inferbus.openai.token_text import TokenTexts
from inferbus.openai.tools import ToolOutput, family_of_template
from inferbus.runtime import logs, tracing
from inferbus.stores.admission import Admission, AdmissionUnavailable, Decision
from inferbus.stores.keys import KeyStore, Principal
from inferbus.stores.models import ModelCatalog
from inferbus.stores.pricing import Prices
from inferbus.stores.tenants import Tenant, TenantStore
from inferbus.tokens.blocks import block_hashes
from inferbus.tokens.prompt import LONG_TEXT_CHARS, PromptError, ServedModel, context_window, load_model, render_prompt
from proto import bands
from proto import messages as m
from services.gateway import metrics

from . import frames, intake
from .adapter_metrics import AdapterMetrics, TopLabels
from .dispatch import Dispatcher
from .flight import DispatchError
from .frames import Call, Choice
from .overload import OverloadPolicy
from .releases import PIN_HEADER, ReleaseRouting
from .settings import GatewaySettings

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.gateway")
_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_VALIDATION_THREADS = 2  # large bodies validated at once, each in a thread (see `_off_loop`)
T = TypeVar("T")

Scope = dict[str, Any]


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
        # The tool-call family: configured, or (`auto`) the one the model's chat template writes.
        self.tool_call_parser = (settings.tool_call_parser if settings.tool_call_parser != "auto"
                                 else family_of_template(self.served.chat_template) or "llama3")
        self.keys = keys
        self.tenants = tenants
        self.admission = admission
        self.overload = overload
        self.prices = prices
        self.releases: ReleaseRouting | None = None  # set by the app: canary splits and release pins
        self.adapter_metrics = AdapterMetrics(TopLabels(time.monotonic, top=settings.adapter_metrics_top))
        self._validating = asyncio.Semaphore(_VALIDATION_THREADS)
        self._admitting: dict[str, int] = {}  # band → requests past the overload check, not yet dispatched

    async def __call__(self, scope: Scope, receive: Any, send: Any, endpoint: str) -> None:
        arrived = time.monotonic()
        request_id = uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            call = await self._admit(scope, receive, request_id, endpoint)
            call.arrived = arrived
        except OpenAIError as error:
            metrics.REQUESTS.labels(endpoint, str(error.status)).inc()
            if error.status >= 500:  # the platform's refusal (no workers, overload, a store down): leave a trace
                log.warning("request_refused", endpoint=endpoint, status=error.status, code=error.code)
            await send_json(send, error.status, error.body(), request_id, error.headers)
            return
        except Exception:
            log.exception("unhandled_error")
            metrics.REQUESTS.labels(endpoint, "500").inc()
            internal = OpenAIError(500, "The server had an error while processing your request.", code="internal_error")
            await send_json(send, 500, internal.body(), request_id)
            return
        metrics.INFLIGHT.inc()
        status = "200"
        try:
            if call.stream:
                status = await self._until_disconnect(receive, self._stream(call, send, request_id))
            else:
                status = await self._until_disconnect(receive, self._respond(call, send, request_id))
        except ClientGone:
            status = "499"
            metrics.ERRORS.labels("client_disconnect").inc()
            for choice in call.choices:
                if choice.final is None:
                    # The bill follows what the client got: the tokens written to it before it left.
                    await self.dispatcher.cancel(choice.flight, "client_disconnect", delivered_tokens=choice.written)
        finally:
            for pump in call.pumps:
                pump.cancel()
            await self._release_lease(call)
            for choice in call.choices:
                self.dispatcher.close(choice.flight)
            metrics.INFLIGHT.dec()
            metrics.REQUESTS.labels(endpoint, status).inc()
            if self.settings.access_log:
                self._access_log(call, status)

    def _access_log(self, call: Call, status: str) -> None:
        flight = call.choices[0].flight  # an admitted call has its first choice's flight (`call.flight`)
        usage = call.usage
        log.info(
            "request", endpoint=call.endpoint, status=int(status), stream=call.stream,
            prompt_tokens=usage.prompt_tokens if usage else flight.prompt_tokens,
            completion_tokens=usage.completion_tokens if usage else flight.sent_tokens,
            cached_tokens=usage.cached_tokens if usage else None,
            ttft_ms=round((call.first_token_at - call.started) * 1000, 2) if call.first_token_at else None,
            admit_ms=round((call.started - call.arrived) * 1000, 2),
            duration_ms=round((time.monotonic() - call.started) * 1000, 2),
            attempts=flight.request.attempt + 1, worker=flight.worker_id, release=flight.request.release,
        )

    # ---- admission: auth, parsing, publishing -----------------------------------------------

    async def _admit(self, scope: Scope, receive: Any, request_id: str, endpoint: str) -> Call:
        principal = await self._authenticate(_header(scope, b"authorization"))
        tenant = await self.tenant(principal)
        body = await self._read_body(receive, _header(scope, b"content-length"))
        if endpoint == "chat":
            parse = functools.partial(schemas.parse_chat, body, max_tools=self.settings.max_tools,
                                      max_messages=self.settings.max_messages)
            # A large body's validation (each tool's JSON Schema, each message) runs in a thread,
            # one at a time, so that it never holds the event loop that serves everyone else.
            chat = await self._off_loop(parse) if len(body) > LONG_TEXT_CHARS else parse()
            model, adapter = await self.catalog.lookup(chat.model, tenant)
            # tool_choice none: the model is not told about the tools (SGLang does the same).
            offered = chat.tools if chat.tools and chat.tool_choice != "none" else None
            render = functools.partial(render_prompt, self.served, messages=msgspec.to_builtins(chat.messages),
                                       tools=offered, **(chat.chat_template_kwargs or {}))
            params: schemas.ChatCompletionRequest | schemas.CompletionRequest = chat
            object_id = f"chatcmpl-{request_id}"
        else:
            completion = schemas.parse_completion(body)
            model, adapter = await self.catalog.lookup(completion.model, tenant)
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
        max_new_tokens = self._max_tokens(params.max_tokens, prompt_tokens, model)  # before any work per token
        pin = _header(scope, PIN_HEADER)
        adapter_canary = adapter_pinned = False
        adapter_fallback = None
        spec = self.catalog.adapters.get(params.model) if adapter else None
        if spec is not None and self.releases is not None:
            # The adapter's version first: it is part of the engine name the prefix hashes are made in.
            adapter, adapter_canary, adapter_pinned, adapter_fallback = self.releases.assign_adapter(
                spec, principal.tenant, prompt.ids, self.settings.block_size, pin)
            pin = None  # the pin named the adapter's version, not the base model's release
        hashes: list[int] = []
        if self.dispatcher.placement_timeout_s > 0:
            # The router places by prefix: the blocks of the ids the engine will cache.
            hashes = block_hashes(prompt.ids, self.settings.block_size, namespace=adapter or "")
        if not self.dispatcher.has_workers(model):
            raise OpenAIError(503, f"No workers are serving `{params.model}` right now; retry shortly.",
                              code="no_capacity", headers={"retry-after": "5"})
        # Platform overload before quotas: a request the platform sheds must not use up its quota.
        ahead = bands.through(tenant.band)
        verdict = self.overload.admit(
            tenant.band,
            sum(self.dispatcher.held(b) + self._admitting.get(b, 0) for b in ahead),
            sum(self.dispatcher.queued(b) for b in ahead),
            self.dispatcher.unstarted_ages(ahead),
            self.dispatcher.oldest_waiting_s(ahead),
        )
        if not verdict.admitted:
            metrics.SHED.labels(tenant.band).inc()
            raise OpenAIError(503, "The platform is overloaded; retry after the delay in `retry-after`.",
                              code="overloaded", headers=verdict.headers())
        # Admitted and not dispatched yet: the requests a burst admits together count for one another.
        self._admitting[tenant.band] = self._admitting.get(tenant.band, 0) + 1
        try:
            release, pinned = (self.releases.assign(model, principal.tenant, hashes, pin, self.dispatcher)
                               if self.releases is not None else (None, False))
            n = params.n
            decision = await self._admission(tenant, request_id, prompt_tokens, max_new_tokens * n)
            now = time.time()
            inference = intake.inference_request(
                params, request_id=request_id, principal=principal, model=model, adapter=adapter, band=tenant.band,
                prompt=prompt, max_new_tokens=max_new_tokens, tool_call_parser=self.tool_call_parser,
                reply_to=self.dispatcher.reply_subject(), timeout_s=self.settings.request_timeout_s, now=now,
                release=release, release_pinned=pinned, adapter_canary=adapter_canary, adapter_pinned=adapter_pinned,
                adapter_fallback=adapter_fallback)
            try:
                carry.check_sampling(inference.sampling)
            except OpenAIError:
                await self._release_reservation(tenant.id, request_id)
                raise
            call = Call(endpoint=endpoint, object_id=object_id, model=params.model, created=int(now),
                         include_usage=bool(params.stream_options and params.stream_options.include_usage),
                         stream=params.stream,
                         headers=[(k.encode(), v.encode()) for k, v in decision.headers().items()],
                         logprobs=inference.sampling.logprobs,
                         latency_labels=metrics.latency_labels(model, adapter, tenant.band),
                         adapter_label=self.adapter_metrics.request(params.model) if adapter else None)
            # Continue the client's trace if it sent `traceparent`; the context rides on to the engine.
            traceparent = _header(scope, b"traceparent")
            with tracing.span(tracer, f"gateway.{endpoint}", {"traceparent": traceparent} if traceparent else None):
                try:
                    for index in range(n):
                        # n > 1: one engine request per choice, with equal prompts, placed beside the
                        # first so that they meet the prompt in the same cache.
                        engine_request = intake.choice_request(inference, index)
                        flight = await self.dispatcher.open(engine_request, weight=tenant.weight, block_hashes=hashes,
                                                            follows=call.choices[0].flight if call.choices else None)
                        call.choices.append(Choice(index=index, flight=flight))
                except DispatchError as error:
                    for choice in call.choices:
                        await self.dispatcher.cancel(choice.flight, "client_disconnect")
                        self.dispatcher.close(choice.flight)
                    await self._release_reservation(tenant.id, request_id)
                    raise OpenAIError(error.status, str(error), code=error.code,
                                      headers={"retry-after": str(int(error.retry_after or 1))}) from None
            call.flight = call.choices[0].flight
            if isinstance(params, schemas.ChatCompletionRequest) and offered:
                for choice in call.choices:
                    choice.tool_output = ToolOutput(self.tool_call_parser, offered, params.tool_choice,
                                                    parallel=params.parallel_tool_calls is not False,
                                                    json_answer=answer_schema(params) is not None)
            return call
        finally:
            self._admitting[tenant.band] -= 1

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """`work()` in a thread, at most `_VALIDATION_THREADS` at a time: validation holds the GIL,
        and more threads doing it would only take turns with the event loop more often."""
        async with self._validating:
            return await asyncio.to_thread(work)

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
        what = {
            "requests": "requests per minute",
            "input_tokens": "input tokens per minute",
            "output_tokens": "output tokens per minute",
            "concurrency": "concurrent requests",
        }.get(decision.reason, decision.reason)
        raise OpenAIError(429, f"Rate limit reached for {what}; retry after the delay in `retry-after`.",
                          code="rate_limit_exceeded", type="rate_limit_error", headers=decision.headers())

    async def _release_lease(self, call: Call) -> None:
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
            raise OpenAIError(
                413, f"Request body too large: {declared} bytes, limit {limit}.", code="request_too_large"
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise OpenAIError(
                    400, "The client closed the connection before sending the body.", code="client_closed"
                )
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"Request body too large: over {limit} bytes.", code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                check = functools.partial(json_body.check_depth, body, self.settings.max_json_depth)
                await self._off_loop(check) if len(body) > LONG_TEXT_CHARS else check()
                return body

    def _max_tokens(self, requested: int | None, prompt_tokens: int, model: str) -> int:
        window = context_window(self.settings.max_model_len, self.served, self.dispatcher.engine_context_length(model))
        return responses.max_new_tokens(requested, prompt_tokens, window, self.settings.default_max_tokens)

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

    async def _events(self, call: Call) -> AsyncIterator[tuple[Choice, m.StreamEvent]]:
        """The events of every choice, as they come, until each has its Final or one fails."""
        if len(call.choices) == 1:
            choice = call.choices[0]
            async for event in self.dispatcher.events(choice.flight):
                yield choice, self._decoded(call, choice, event)
            return
        merged: asyncio.Queue[tuple[Choice, m.StreamEvent | None]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for event in self.dispatcher.events(choice.flight):
                merged.put_nowait((choice, event))
            merged.put_nowait((choice, None))

        # Cancelled when the response ends, however it ends (see __call__).
        call.pumps = [asyncio.ensure_future(pump(choice)) for choice in call.choices]
        running = len(call.pumps)
        while running:
            choice, item = await merged.get()
            if item is None:
                running -= 1
                continue
            yield choice, self._decoded(call, choice, item)

    def _decoded(self, call: Call, choice: Choice, event: m.StreamEvent) -> m.StreamEvent:
        """The event with its logprob tokens' text decoded in context, so that they join up to the
        content whatever the tokenizer (the engine decodes each token alone)."""
        if not call.logprobs or not isinstance(event, (m.TokenChunk, m.Final)) or not event.logprobs:
            return event
        if choice.token_texts is None:
            choice.token_texts = TokenTexts(self.served.decode, choice.flight.request.input_ids)
        return msgspec.structs.replace(event, logprobs=choice.token_texts.rewrite(event.logprobs,
                                                                          final=isinstance(event, m.Final)))

    def _quiet(self, call: Call) -> bool:
        """Nothing more is queued for this response right now."""
        return all(choice.flight.events.empty() for choice in call.choices)

    def _usage_of(self, call: Call) -> m.Usage:
        """OpenAI's usage of n choices: the prompt once, the completions summed."""
        finals = [choice.final for choice in call.choices if choice.final is not None]
        first = finals[0].usage
        if len(finals) == 1:
            return first
        return m.Usage(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                       completion_tokens=sum(f.usage.completion_tokens for f in finals))

    async def _stream(self, call: Call, send: Any, request_id: str) -> str:
        deadline = call.choices[0].flight.request.deadline
        # Headers at once: a streaming client learns its request id while the request waits.
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, (b"x-request-id", request_id.encode()), *call.headers]})
        out: list[bytes] = []
        status = "200"
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                async for choice, event in self._events(call):
                    if isinstance(event, m.TokenChunk):
                        if event.text or not choice.started:
                            self._first_token(call, not choice.started)
                            out.extend(frames.chunks(call, choice, event.text, event.logprobs))
                            choice.framed = event.completion_tokens
                        elif call.logprobs:  # tokens without text yet: their logprobs go with the next chunk
                            choice.pending_logprobs.extend(event.logprobs or ())
                        if self._quiet(call):  # write what has queued up in one go
                            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                            out.clear()
                            for written in call.choices:
                                written.written = written.framed
                        continue
                    if isinstance(event, m.Final):
                        if event.text or not choice.started or choice.tool_output is not None:
                            self._first_token(call, not choice.started)
                            out.extend(frames.chunks(call, choice, event.text, event.logprobs, final=True))
                        elif call.logprobs:
                            choice.pending_logprobs.extend(event.logprobs or ())
                        finish = responses.finish_reason(event.finish_reason, choice.tool_calls_sent > 0)
                        out.append(frames.chunk(call, None if call.endpoint == "chat" else "", finish, False,
                                                  index=choice.index, choice=choice,
                                                  logprobs=choice.pending_logprobs if call.logprobs else None))
                        choice.final = event
                        if any(c.final is None for c in call.choices):
                            continue
                        usage = self._usage_of(call)
                        if call.include_usage:
                            out.append(frames.usage_chunk(call, usage))
                        self._record(call, usage)
                    else:
                        error = intake.event_error(event)
                        status = str(error.status)
                        out.append(b"data: " + _json.encode(error.body()) + b"\n\n")
                        await self._give_up(call, choice, error)
                    break
        except TimeoutError:
            error = OpenAIError(504, "The request did not finish before its deadline.", code="timeout")
            status = "504"
            out.append(b"data: " + _json.encode(error.body()) + b"\n\n")
            await self._give_up(call, None, error, cancel_reason="deadline")
        await self._release_lease(call)
        out.append(DONE)
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
        return status

    async def _respond(self, call: Call, send: Any, request_id: str) -> str:
        deadline = call.choices[0].flight.request.deadline
        failed: tuple[Choice, m.StreamEvent] | None = None
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                async for choice, event in self._events(call):
                    if isinstance(event, (m.TokenChunk, m.Final)):
                        choice.parts.append(event.text)
                        choice.logprobs.extend(event.logprobs or ())
                        if isinstance(event, m.Final):
                            choice.final = event
                            if all(c.final is not None for c in call.choices):
                                break
                        continue
                    failed = (choice, event)
                    break
        except TimeoutError:
            error = OpenAIError(504, "The request did not finish before its deadline.", code="timeout")
            await self._give_up(call, None, error, cancel_reason="deadline", delivered=False)
            await send_json(send, 504, error.body(), request_id)
            return "504"
        if failed is not None or any(c.final is None for c in call.choices):
            choice = failed[0] if failed else call.choices[0]
            error = intake.event_error(failed[1]) if failed else OpenAIError(502, "No response from the worker.")
            await self._give_up(call, choice, error, delivered=False)
            await send_json(send, error.status, error.body(), request_id, error.headers)
            return str(error.status)
        self._first_token(call, True)
        usage = self._usage_of(call)
        self._record(call, usage)
        await self._release_lease(call)
        await send_json(send, 200, frames.completion_body(call, usage), request_id,
                        {k.decode(): v.decode() for k, v in call.headers})
        return "200"

    # ---- bookkeeping ------------------------------------------------------------------------

    def _first_token(self, call: Call, first: bool) -> None:
        if first and call.first_token_at is None:
            call.first_token_at = time.monotonic()
            metrics.TTFT.labels(*call.latency_labels).observe(call.first_token_at - call.started)
            if call.adapter_label is not None:
                self.adapter_metrics.first_token(call.adapter_label, call.first_token_at - call.started)

    def _record(self, call: Call, usage: m.Usage) -> None:
        first = call.choices[0]
        call.usage = usage
        end = time.monotonic()
        metrics.E2E.labels(*call.latency_labels).observe(end - call.started)
        generated = first.final.usage.completion_tokens if first.final is not None else 0
        if call.first_token_at is not None and generated > 1:
            metrics.TPOT.labels(*call.latency_labels).observe((end - call.first_token_at) / (generated - 1))
        if first.flight.queue_wait is not None:
            metrics.QUEUE_WAIT.labels(*call.latency_labels).observe(first.flight.queue_wait)
        metrics.TOKENS.labels("prompt").inc(usage.prompt_tokens)
        metrics.TOKENS.labels("completion").inc(usage.completion_tokens)
        metrics.TOKENS.labels("cached").inc(usage.cached_tokens)

    async def _give_up(self, call: Call, failed: Choice | None, error: OpenAIError,
                       cancel_reason: str | None = None, delivered: bool = True) -> None:
        """End a response that failed: `failed` is the choice that did (None: all of them, e.g.
        the deadline); the other unfinished choices are given up too, the client gets none of them.

        Billing = delivery: the gateway, which alone knows what the client received, bills each
        unfinished choice for that (the tokens streamed to it; nothing when `delivered` is False,
        a non-streamed response that fails); a worker still on one stops and bills its work to
        the platform."""
        metrics.ERRORS.labels(error.code or error.type).inc()
        for choice in call.choices:
            if choice.final is not None:
                continue
            if cancel_reason:
                await self.dispatcher.cancel(choice.flight, cancel_reason)
            else:
                await self.dispatcher.supersede(choice.flight)
            await self.dispatcher.publish_usage(choice.flight, "failed", "error",
                                                delivered_tokens=choice.flight.sent_tokens if delivered else 0)




async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
