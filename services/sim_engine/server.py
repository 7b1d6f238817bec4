"""HTTP shell of the simulated engine: SGLang 0.5.23's native API over the pure scheduler.

One background task runs the engine: it sleeps while idle, otherwise takes a step, waits the
step's simulated duration scaled by `time_scale`, and hands each request's new state to that
request's queue. Handlers only validate, enqueue and stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from inferbus.timing import StepTimeModel
from inferbus.tokens.blocks import VOCAB_SIZE, encode
from inferbus.tokens.prompt import ServedModel, load_model

from . import quality, reports
from .config import EngineConfig
from .constrained import SchemaError
from .disagg import Bootstrap
from .faults import Faults, Mode
from .kv_publisher import KvEventPublisher, KvEventsConfig
from .lora_routes import LoraRoutes
from .metrics import EngineMetrics
from .output import OutputVocabulary
from .request import Request, RequestRejected, RequestUpdate
from .responses import encode_json, error_response, json_response
from .sampling import SamplingParams
from .scheduler import Engine
from .scripted import scripted_output
from .streams import Stream

logger = logging.getLogger("inferbus.sim_engine")

HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"
HEALTH_CHECK_TIMEOUT_S = 20.0
# If the event loop falls behind the simulated schedule by more than this, stop trying to catch up.
MAX_SCHEDULE_LAG_S = 0.1


class GenerateInput(msgspec.Struct):
    """The /generate body. Fields SGLang has and the simulator ignores (return_logprob, ...) pass."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    stream: bool = False
    rid: str | None = None
    lora_path: str | None = None
    priority: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1
    # Prefill/decode disaggregation: where the prefill engine's bootstrap server is, and the room
    # both engines know this request by (disagg_server.py).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    bootstrap_pair_key: str | None = None

    def bootstrap(self) -> Bootstrap | None:
        return None if self.bootstrap_room is None else Bootstrap(self.bootstrap_host, self.bootstrap_port,
                                                                  self.bootstrap_room)


class AbortInput(msgspec.Struct):
    rid: str = ""
    abort_all: bool = False


class _TimeScaleBody(msgspec.Struct):
    time_scale: float


async def _rejected_stream(message: str) -> AsyncIterator[bytes]:
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    yield b"data: " + encode_json({"error": error}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _in_context(served: ServedModel, token_id: int) -> str:
    """A token's text as it reads after a word, the way the engine's detokenizer writes the output
    (a SentencePiece-style token keeps its leading space, which decoding it alone drops)."""
    anchor = served.encode("The", add_special_tokens=False)
    before = served.tokenizer.decode(anchor, skip_special_tokens=False)
    text = served.tokenizer.decode([*anchor, token_id], skip_special_tokens=False)
    return (
        text[len(before) :]
        if text.startswith(before)
        else served.tokenizer.decode([token_id], skip_special_tokens=False)
    )


def _alone(served: ServedModel, token_id: int) -> str:
    """A token's text decoded alone (a SentencePiece-style token without its leading space)."""
    return served.tokenizer.decode([token_id], skip_special_tokens=False)


class SimEngineServer:
    """Owns the engine, the step loop and the Starlette app (`.app`)."""

    def __init__(self, config: EngineConfig, step_model: StepTimeModel | None = None) -> None:
        self.config = config
        # The served model's tokenizer: text in, output ids of its vocabulary out (stand-in without one).
        self.served = load_model(config.model_dir) if config.model_dir else None
        if self.served is not None:
            served = self.served
            if served.context_length and not config.context_length_set:
                config.context_length = served.context_length  # the model's own, as SGLang derives it
            vocabulary = OutputVocabulary.from_tokenizer(
                lambda text: served.encode(text, add_special_tokens=False), functools.partial(_in_context, served),
                served.eos_token_ids[0] if served.eos_token_ids else 0)
            self.engine = Engine(config, step_model, vocabulary)
        else:
            self.engine = Engine(config, step_model)
        self.eval_accuracy = quality.accuracy_of(config.model_dir, config.eval_accuracy)
        self._adapter_accuracy: dict[str, float] = {}  # adapter path → its accuracy (quality.adapter_accuracy)
        self.vocab_size = self.served.vocab_size if self.served is not None else VOCAB_SIZE
        self.metrics = EngineMetrics(config.model)
        self._streams: dict[str, Stream] = {}
        self._wake = asyncio.Event()
        self._idle_since: float | None = None  # when the step loop went idle, if it is
        # Wall seconds per simulated second; `/time_scale` (--time-scale-control) changes it.
        self.time_scale = config.time_scale
        self._loop_task: asyncio.Task[None] | None = None
        self.kv_events = KvEventPublisher(KvEventsConfig.parse(config.kv_events_config))
        routes = [
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            *LoraRoutes(self).routes(),
            Route("/v1/loads", self.loads, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/metrics", self.prometheus_metrics, methods=["GET"]),
        ]
        self.faults: Faults | None = None  # set by `enable_faults` (--fault-injection)
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    def enable_time_scale_control(self) -> None:
        """Serve `GET/POST /time_scale {"time_scale": S}` (--time-scale-control): a benchmark speeds
        up an idle phase (adapter prefetching) without changing any simulated duration."""
        self.app.router.routes.append(Route("/time_scale", self.time_scale_endpoint, methods=["GET", "POST"]))

    async def time_scale_endpoint(self, http_request: HttpRequest) -> Response:
        if http_request.method == "POST":
            try:
                body = msgspec.json.decode(await http_request.body(), type=_TimeScaleBody)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                return error_response(str(exc))
            if body.time_scale <= 0:
                return error_response("time_scale must be positive")
            self.time_scale = body.time_scale
            self._wake.set()  # an idle wait so far is accounted at the old scale
        return json_response({"time_scale": self.time_scale})

    def enable_faults(self, mode: Mode = "none") -> None:
        """Serve `/fault` and obey it (see services/sim_engine/faults.py)."""
        self.faults = Faults(mode)
        self.app.router.routes.append(self.faults.route())

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._loop_task = asyncio.create_task(self._run(), name="sim-engine-steps")
        try:
            yield
        finally:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self.kv_events.close()

    # ------------------------------------------------------------------ step loop

    async def _run(self) -> None:
        engine = self.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            scale = self.time_scale
            if self.faults is not None and self.faults.hung:
                await self.faults.wait_unhung()  # a hung GPU: nothing runs, nothing finishes
                deadline = loop.time()
                continue
            if not engine.has_work:
                await self._idle(scale)
                deadline = loop.time()
                continue
            result = engine.step()
            self._stepped()
            self.kv_events.publish(engine.cache)
            if result.idle:
                await self._idle(scale)
                deadline = loop.time()
                continue
            delay = result.duration_s * scale
            if delay > 0:
                # Sleep to an absolute schedule so per-step overheads do not add up.
                deadline = max(deadline + delay, loop.time() - MAX_SCHEDULE_LAG_S)
                await asyncio.sleep(max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0)
            self._deliver(result.updates)

    def _stepped(self) -> None:
        """After each step, before its duration has passed (the prefill/decode shell sends KV here)."""

    async def _idle(self, scale: float) -> None:
        self._wake.clear()
        self._idle_since = time.monotonic()
        await self._wake.wait()
        self.catch_up()
        self._idle_since = None

    def wake(self) -> None:
        """Something changed that the step loop may act on (a request, an adapter, the time scale)."""
        self._wake.set()

    def catch_up(self) -> None:
        """Idle wall time is simulated time too: brought in before anything that reads the engine's
        clock (a load starts now, not when the engine went idle)."""
        if self._idle_since is not None and self.time_scale > 0:
            now = time.monotonic()
            self.engine.advance((now - self._idle_since) / self.time_scale)
            self._idle_since = now

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for update in updates:
            stream = self._streams.get(update.request.rid)
            if stream is None:
                continue
            new_tokens = update.num_output_tokens - stream.tokens_seen
            if new_tokens > 0 and not stream.internal:
                metrics.generation_tokens.inc(new_tokens)
                if stream.tokens_seen == 0:
                    metrics.ttft.observe(now - stream.arrival)
                else:
                    metrics.itl.observe((now - stream.last_token_at) / new_tokens)
                stream.last_token_at = now
            stream.tokens_seen = update.num_output_tokens
            if update.finish_reason is not None:
                if not stream.internal:
                    metrics.e2e.observe(now - stream.arrival)
                # The stream is done: later updates for this rid (a step that ran while the
                # abort was being delivered) are dropped.
                del self._streams[update.request.rid]
            elif update.num_output_tokens % stream.interval:
                continue
            stream.queue.put_nowait(update)

    def decode(self, input_ids: list[int]) -> str:
        """A prompt given as ids, as text with its special tokens (what the tool-call and schema
        scripts read); the stand-in tokenizer cannot be decoded."""
        if self.served is None:
            return ""
        return self.served.tokenizer.decode(input_ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Text as SGLang tokenizes a /generate prompt: with the tokenizer's special tokens (BOS)."""
        if self.served is None:
            return encode(text)
        return self.served.encode(text, add_special_tokens=True)

    # ------------------------------------------------------------------ /generate

    async def generate(self, http_request: HttpRequest) -> Response:
        if self.faults is not None and self.faults.failing:
            return self.faults.failure()
        try:
            body = msgspec.json.decode(await http_request.body(), type=GenerateInput)
            sampling = body.sampling_params or SamplingParams()
            sampling.verify()
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            return error_response(str(exc))
        if (body.text is None) == (body.input_ids is None):
            return error_response("Exactly one of text or input_ids must be provided.")
        if body.input_ids is not None and any(not 0 <= t < self.vocab_size for t in body.input_ids):
            return error_response(f"input_ids must be token ids in [0, {self.vocab_size}).")
        traceparent = http_request.headers.get("traceparent")
        rid = body.rid or uuid.uuid4().hex
        if traceparent:
            logger.debug("generate rid=%s traceparent=%s", rid, traceparent)
        input_ids = body.input_ids if body.input_ids is not None else self.encode(body.text or "")
        if body.top_logprobs_num < 0:
            return error_response(f"top_logprobs_num must be at least 0, got {body.top_logprobs_num}.")
        try:
            script = self._script(
                body.text if body.text is not None else self.decode(input_ids), input_ids, sampling, rid, body.lora_path
            )
        except SchemaError as exc:
            return error_response(f"Invalid grammar request: {exc}")
        request = Request(
            rid=rid, input_ids=input_ids, sampling=sampling, priority=body.priority or 0, lora_name=body.lora_path,
            script=script, return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
        )
        try:
            stream = self.submit(request, sampling.stream_interval or 1, bootstrap=body.bootstrap())
        except RequestRejected as exc:
            if body.stream:  # SGLang has started the stream by then: 200, the error in-band
                return StreamingResponse(_rejected_stream(str(exc)), media_type="text/event-stream")
            return error_response(str(exc))
        if body.stream:
            return StreamingResponse(self._stream_events(request, stream), media_type="text/event-stream")
        try:
            update = await self.final_update(stream)
        except asyncio.CancelledError:
            self.abort_if_running(rid)
            raise
        status = (update.finish_reason or {}).get("status_code")
        if isinstance(status, int) and 400 <= status < 600:  # an abort with a status is an HTTP error, as SGLang
            message = str((update.finish_reason or {}).get("message"))
            if status == 400:
                return error_response(message)
            return json_response(
                {"object": "error", "message": message, "type": str(status), "param": None, "code": status}, status
            )
        return json_response(self._payload(request, update, stream, final=True))

    def _accuracy(self, lora_name: str | None) -> float:
        adapter = self.engine.adapters.get(lora_name) if lora_name else None
        if adapter is None:
            return self.eval_accuracy
        found = self._adapter_accuracy.get(adapter.path)
        if found is None:
            found = self._adapter_accuracy[adapter.path] = quality.adapter_accuracy(adapter.path, self.eval_accuracy)
        return found

    def _script(self, text: str, input_ids: list[int], sampling: SamplingParams, rid: str = "",
                lora_name: str | None = None) -> list[tuple[int, str]] | None:
        """The output decided up front (scripted.py), split into the served model's tokens."""
        output = scripted_output(text, input_ids, sampling, rid, lambda: self._accuracy(lora_name),
                                 self.config.tool_call_parser)
        return None if output is None else self.engine.split_output(output)

    def submit(self, request: Request, stream_interval: int, internal: bool = False,
                bootstrap: Bootstrap | None = None) -> Stream:
        if request.rid in self._streams:
            raise RequestRejected("Duplicate request ID detected")
        self.catch_up()  # an implicit reload starts now
        self.engine.add(request)
        stream = Stream(time.monotonic(), stream_interval, internal)
        self._streams[request.rid] = stream
        if not internal:
            self.metrics.prompt_tokens.inc(len(request.input_ids))
        self._wake.set()
        return stream

    async def _stream_events(self, request: Request, stream: Stream) -> AsyncIterator[bytes]:
        finished = False
        try:
            while not finished:
                update = await stream.queue.get()
                finished = update.finish_reason is not None
                yield b"data: " + encode_json(self._payload(request, update, stream, final=finished)) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - reported in-band, as SGLang does mid-stream
            logger.exception("stream %s failed", request.rid)
            error = {"message": str(exc), "type": "InternalServerError", "code": 500, "retryable": True}
            yield b"data: " + encode_json({"error": error}) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            # Client went away (or the stream failed): stop generating for it.
            if not finished:
                self.abort_if_running(request.rid)

    @staticmethod
    async def final_update(stream: Stream) -> RequestUpdate:
        while True:
            update = await stream.queue.get()
            if update.finish_reason is not None:
                return update

    def _payload(self, request: Request, update: RequestUpdate, stream: Stream, final: bool) -> dict[str, Any]:
        e2e_latency = time.monotonic() - stream.arrival if final else None
        # The logprobs' text: each token decoded alone by the served model (the stand-in's is kept).
        token_text = None if self.served is None else functools.partial(_alone, self.served)
        return reports.generate_payload(request, update, e2e_latency, token_text)

    def abort_if_running(self, rid: str) -> None:
        if self.engine.get(rid) is not None:
            self._deliver(self.engine.abort(rid, "Client disconnected.", exact=True))
        self._streams.pop(rid, None)

    # ------------------------------------------------------------------ control endpoints

    async def abort_request(self, http_request: HttpRequest) -> Response:
        try:
            body = msgspec.json.decode(await http_request.body() or b"{}", type=AbortInput)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(str(exc))
        if body.abort_all:
            self._deliver(self.engine.abort("", "Abort all requests."))
        elif body.rid:
            self._deliver(self.engine.abort(body.rid, "Abort by abort_request."))
        return Response(status_code=200)

    async def loads(self, http_request: HttpRequest) -> Response:
        return json_response(self.loads_payload())

    def loads_payload(self) -> dict[str, Any]:
        return reports.loads(self.engine.load(), time.time())

    async def ready(self, http_request: HttpRequest) -> Response:
        return Response(status_code=200)

    async def health(self, http_request: HttpRequest) -> Response:
        """Like SGLang: pass a 1-token generation through the scheduler."""
        if self.faults is not None and self.faults.failing:
            return self.faults.failure()
        request = Request(
            rid=HEALTH_CHECK_PREFIX + uuid.uuid4().hex,
            input_ids=self.encode("health"),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        stream = self.submit(request, 1, internal=True)
        try:
            update = await asyncio.wait_for(self.final_update(stream), HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.abort_if_running(request.rid)
            return Response(status_code=503)
        return Response(status_code=200 if (update.finish_reason or {}).get("type") == "length" else 503)

    async def server_info(self, http_request: HttpRequest) -> Response:
        return json_response(self.server_info_payload())

    def server_info_payload(self) -> dict[str, Any]:
        return reports.server_info(self.config, self.engine.cache.capacity_tokens, self.time_scale, self.eval_accuracy)

    async def model_info(self, http_request: HttpRequest) -> Response:
        return json_response(self.model_info_payload())

    def model_info_payload(self) -> dict[str, Any]:
        return reports.model_info(self.config)

    async def flush_cache(self, http_request: HttpRequest) -> Response:
        if self.engine.flush_cache():
            self.kv_events.publish(self.engine.cache)
            return Response("Cache flushed.\n", status_code=200)
        return Response(
            "Cache not flushed: there are running or waiting requests.\n", status_code=400
        )

    async def prometheus_metrics(self, http_request: HttpRequest) -> Response:
        snapshot = self.engine.load()
        metrics = self.metrics
        metrics.num_running.set(snapshot.num_running_reqs)
        metrics.num_queue.set(snapshot.num_waiting_reqs)
        metrics.token_usage.set(snapshot.token_usage)
        metrics.cache_hit_rate.set(snapshot.cache_hit_rate)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
