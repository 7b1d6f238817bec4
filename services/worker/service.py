"""Worker: pulls requests by affinity, drives one engine, streams tokens back over NATS.

Ownership of a request: the worker acks the JetStream message when it hands the request to the
engine and tells the gateway (`Accepted`). From then on the gateway, which holds the client,
watches this worker's heartbeat and migrates the request if the worker dies. A worker that dies
between pull and accept leaves the message unacked; JetStream redelivers it after `ack_wait`.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from inferbus import adapters as adapter_registry
from inferbus import bus, logs, tracing
from inferbus.replies import Replies
from proto import messages as m
from proto import subjects

from .adapters import Adapters
from .cache_events import CacheRelay
from .engine import EngineClient, EngineError, EngineUpdate
from .puller import Puller
from .settings import WorkerSettings
from .slots import SlotBudget

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.worker")

REQUESTS = Counter("inferbus_worker_requests_total", "Requests finished by this worker", ["status"])
RUNNING = Gauge("inferbus_worker_running_requests", "Requests this worker holds")
FREE_SLOTS = Gauge("inferbus_worker_free_slots", "Slots free for new requests")
KV_USAGE = Gauge("inferbus_worker_kv_usage_ratio", "Engine KV cache use (0-1)")
ENGINE_ERRORS = Counter("inferbus_worker_engine_errors_total", "Engine failures seen by this worker")
QUEUE_WAIT = Histogram(
    "inferbus_worker_queue_wait_seconds",
    "Gateway accept to engine submit",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

LOAD_REPORT_MIN_GAP_S = 0.02  # at most ~50 load reports a second, however busy
SCARCE_POLL_S = 0.05  # a consumer's turn when slots are scarce: a waiting request waits ≲ 4 turns
CANCEL_MEMORY_S = 900.0  # longer than a request may wait in the queue in practice
CANCEL_MEMORY_SIZE = 100_000
_request_decoder = msgspec.msgpack.Decoder(m.InferenceRequest)
_cancel_decoder = msgspec.msgpack.Decoder(m.Cancel)


@dataclass
class _Running:
    request: m.InferenceRequest
    task: asyncio.Task[None] | None = None  # held here: the event loop keeps only weak references
    cancelled: bool = False
    handed_off: bool = False
    prefilled: bool = False  # the engine has produced its first token


@dataclass
class Worker:
    settings: WorkerSettings
    nc: Client | None = None
    js: JetStreamContext | None = None
    kv: KeyValue | None = None
    engine: EngineClient = field(init=False)
    budget: SlotBudget | None = None
    running: dict[str, _Running] = field(default_factory=dict)
    draining: bool = False
    started: float = field(default_factory=time.time)
    _pullers: list[Puller] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _load_seq: int = 0
    _engine_info: dict = field(default_factory=dict)
    replies: Replies | None = None
    # Cancels seen for requests this worker does not hold (yet): a request pulled after its
    # client went away is refused instead of generated for nobody. request id → when seen.
    _cancelled: dict[str, float] = field(default_factory=dict)
    _background: set[asyncio.Task[None]] = field(default_factory=set)  # usage publishes in flight
    _drain_task: asyncio.Task[None] | None = None
    _completed: int = 0  # requests finished, reported with load for the gateways' overload policy
    _outbox: dict[str, list[m.StreamEvent]] = field(default_factory=dict)
    _outbox_flush_scheduled: bool = False
    _load_changed: asyncio.Event = field(default_factory=asyncio.Event)
    _pulled_own: int = 0  # requests taken from this worker's own queue (routers compare with their placements)
    _own_target: str = ""
    adapters: Adapters = field(init=False)
    cache_relay: CacheRelay | None = None

    def __post_init__(self) -> None:
        self.engine = EngineClient(self.settings.engine_url)
        self._own_target = "." + subjects.worker_target(self.settings.worker_id)
        self.adapters = Adapters(self.engine, self._lookup_adapter)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        await self.engine.start()
        await self._wait_for_engine()
        self._engine_info = await self.engine.server_info()
        capacity = s.max_running or int(self._engine_info.get("max_running_requests") or 64)
        tiers = s.tier_list()
        self.budget = SlotBudget(capacity, pullers=2 * len(tiers))
        FREE_SLOTS.set(capacity)

        self.nc = await bus.connect(s.nats_url, name=f"worker-{s.worker_id}", on_reconnect=self._on_reconnect)
        self.js = self.nc.jetstream()
        self.replies = Replies(self.nc)
        await self.replies.start()
        self._adapter_kv = await adapter_registry.bucket(self.js)
        if s.engine_kv_events:
            self.cache_relay = CacheRelay(self.nc, s.worker_id, s.engine_kv_events)
            self.cache_relay.start()
        # Control first: the router asks a worker for its cache as soon as its heartbeat appears.
        await self.nc.subscribe(subjects.control_subject(s.worker_id), cb=self._on_control)
        consumers = await self._setup_bus()
        await self.nc.subscribe(subjects.cancel_wildcard(), cb=self._on_cancel)
        for consumer in consumers:  # most important first: earlier pullers get slots first
            puller = Puller(
                self.nc, subjects.REQUESTS_STREAM, consumer, self.budget, self._on_request,
                wake=self._wake, expires_s=s.fetch_timeout_s,
            )
            await puller.start()
            self._pullers.append(puller)

        await self._heartbeat()
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="pull"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._load_loop(), name="load"),
        ]
        log.info("worker_ready", worker_id=s.worker_id, engine=s.engine_url, capacity=capacity, tiers=tiers)

    async def _wait_for_engine(self) -> None:
        deadline = time.monotonic() + 600
        while not await self.engine.ready():
            if time.monotonic() > deadline:
                raise SystemExit(f"engine at {self.settings.engine_url} not ready after 600 s")
            await asyncio.sleep(0.2)

    async def _ensure_consumer(self, tier: str, owner: str | None) -> str:
        assert self.js is not None
        name = subjects.request_consumer(tier, self.settings.model, owner)  # type: ignore[arg-type]
        target = subjects.ANY_TARGET if owner is None else subjects.worker_target(owner)
        config = ConsumerConfig(
            durable_name=name,
            filter_subject=subjects.request_subject(tier, self.settings.model, target),  # type: ignore[arg-type]
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait_s,
            max_ack_pending=-1,
            max_waiting=4096,
        )
        try:
            await self.js.add_consumer(subjects.REQUESTS_STREAM, config)
        except BadRequestError as error:
            if error.err_code != 10148:  # exists with another config: keep using it
                raise
        return name

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._start_drain)
        await self.start()
        await self._stopped.wait()

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stop pulling, let in-flight requests finish for a while, hand the rest back, leave."""
        if self.draining:
            return
        self.draining = True
        log.info("worker_draining", in_flight=len(self.running))
        for puller in self._pullers:
            await puller.stop()
        await self._heartbeat()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for entry in list(self.running.values()):
            entry.handed_off = True
            await self.engine.abort(entry.request.engine_rid())
        while self.running:
            await asyncio.sleep(0.01)
        await self.stop()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._background:  # usage events are the billing ledger: let them land
            await asyncio.wait(self._background, timeout=10)
        if self.kv is not None:
            try:
                await self.kv.delete(subjects.worker_key(self.settings.worker_id))
            except Exception as error:
                log.warning("heartbeat_delete_failed", error=repr(error))
        if self.cache_relay is not None:
            await self.cache_relay.stop()
        if self.nc is not None:
            await self.nc.drain()
        await self.engine.close()
        log.info("worker_stopped")
        self._stopped.set()

    # ---- pulling ---------------------------------------------------------------------------

    async def _setup_bus(self) -> list[str]:
        """Streams, the heartbeat bucket and this worker's consumers; idempotent, so a worker can
        run it again after a reconnect to a server that lost them."""
        assert self.js is not None
        await bus.ensure_streams(self.js)
        self.kv = await bus.workers_bucket(self.js, self.settings.heartbeat_ttl_s)
        # Heartbeat before the consumers exist: a router never sees a queue without its worker.
        await self._heartbeat()
        return [
            await self._ensure_consumer(tier, owner)
            for tier in self.settings.tier_list()
            for owner in (self.settings.worker_id, None)
        ]

    async def _on_reconnect(self) -> None:
        await bus.retry_forever("bus setup after reconnect", self._setup_bus)  # type: ignore[arg-type]
        for puller in self._pullers:  # the server may have lost our pull requests
            puller.forget_pulls()

    async def _pull_loop(self) -> None:
        assert self.budget is not None
        pullers = self._pullers
        turn = 0
        while not self.draining:
            self._wake.clear()
            if self.budget.free >= len(pullers):
                # Room for every consumer: all long-poll at once, most important first.
                for puller in pullers:
                    await puller.pull()
            else:
                # Fewer free slots than consumers: a long-poll on an empty queue would hold a slot
                # that a busy queue needs, so consumers take short turns in rotation instead.
                for i in range(len(pullers)):
                    puller = pullers[(turn + i) % len(pullers)]
                    if await puller.pull(SCARCE_POLL_S):
                        turn = (turn + i + 1) % len(pullers)
            FREE_SLOTS.set(self.budget.free)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.fetch_timeout_s)
            except asyncio.TimeoutError:
                pass

    def _on_request(self, msg: Msg) -> None:
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.DecodeError as error:
            log.error("bad_request_message", error=str(error))
            self._spawn(msg.term())
            self._release_slot()
            return
        if msg.subject.endswith(self._own_target):
            self._pulled_own += 1
        entry = _Running(request=request)
        self.running[request.request_id] = entry
        RUNNING.set(len(self.running))
        entry.task = asyncio.ensure_future(self._serve(msg, entry))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release_slot(self) -> None:
        assert self.budget is not None
        self.budget.release(1)
        self._wake.set()

    # ---- serving one request ---------------------------------------------------------------

    async def _serve(self, msg: Msg, entry: _Running) -> None:
        request = entry.request
        structlog.contextvars.bind_contextvars(request_id=request.request_id, tenant=request.tenant)
        with tracing.span(tracer, "worker.generate", msg.headers) as trace_headers:
            status, usage, finish = "failed", m.Usage(prompt_tokens=0, completion_tokens=request.resumed_tokens), None
            publish_usage = True
            try:
                await msg.ack()
                if request.request_id in self._cancelled:
                    status, finish = "cancelled", "abort"
                    return
                if time.time() > request.deadline:
                    finish = "error"
                    self._send(request, m.StreamError(
                        request_id=request.request_id, attempt=request.attempt, code="timeout",
                        message="request deadline passed before a worker could start it", status=504,
                    ))
                    return
                queue_wait = max(0.0, time.time() - request.created)
                QUEUE_WAIT.observe(queue_wait)
                self._send(request, m.Accepted(
                    request_id=request.request_id, attempt=request.attempt,
                    worker_id=self.settings.worker_id, queue_wait=queue_wait,
                ))
                status, usage, finish = await self._generate(request, entry, trace_headers)
                if entry.handed_off:
                    publish_usage = False  # the next attempt reports the client-visible totals
                    self._send(request, m.Handoff(
                        request_id=request.request_id, attempt=request.attempt, worker_id=self.settings.worker_id
                    ))
            except EngineError as error:
                ENGINE_ERRORS.inc()
                log.warning("engine_error", code=error.code, error=str(error), retryable=error.retryable)
                # A retryable failure may continue on another worker, whose usage event counts it.
                publish_usage = not error.retryable
                self._send(request, m.StreamError(
                    request_id=request.request_id, attempt=request.attempt, code=error.code,
                    message=str(error), retryable=error.retryable, status=error.status,
                ))
            except Exception as error:  # never leave a client hanging on a bug
                log.exception("worker_request_failed")
                self._send(request, m.StreamError(
                    request_id=request.request_id, attempt=request.attempt, code="internal_error",
                    message=f"worker failed: {type(error).__name__}", retryable=True, status=500,
                ))
                publish_usage = False
            finally:
                self.running.pop(request.request_id, None)
                RUNNING.set(len(self.running))
                self._release_slot()
                self._completed += 1
                REQUESTS.labels(status).inc()
                structlog.contextvars.unbind_contextvars("request_id", "tenant")
                if publish_usage:
                    # Spawned, not awaited: this also runs after the early returns above.
                    self._spawn(self._publish_usage(request, status, usage, finish))

    async def _generate(
        self, request: m.InferenceRequest, entry: _Running, trace_headers: dict[str, str]
    ) -> tuple[str, m.Usage, str | None]:
        seq = 0
        completion = request.resumed_tokens
        prompt_tokens = request.prompt_tokens
        cached = 0
        update: EngineUpdate
        if request.adapter:
            await self.adapters.ensure(request.adapter)
        async for update in self.engine.generate(request, trace_headers):
            if not entry.prefilled:
                entry.prefilled = True
                self._load_changed.set()  # its prefill is done: tell the router now, not at the next tick
            completion = request.resumed_tokens + update.completion_tokens
            if prompt_tokens is None and update.prompt_tokens is not None:
                prompt_tokens = max(0, update.prompt_tokens - request.resumed_tokens)
            cached = min(update.cached_tokens, prompt_tokens or 0)
            if update.finish is None:
                self._send(request, m.TokenChunk(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=update.text,
                    completion_tokens=completion, prompt_tokens=prompt_tokens if seq == 0 else None,
                ))
                seq += 1
                continue
            finish_type = update.finish.get("type")
            reason: m.FinishReason = {"stop": "stop", "length": "length", "abort": "abort"}.get(finish_type, "stop")  # type: ignore[assignment]
            matched = update.finish.get("matched")
            usage = m.Usage(prompt_tokens=prompt_tokens or 0, completion_tokens=completion, cached_tokens=cached)
            if not entry.handed_off:
                self._send(request, m.Final(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=update.text,
                    finish_reason=reason, usage=usage, matched_stop=matched if isinstance(matched, str) else None,
                    worker_id=self.settings.worker_id,
                ))
            status = "cancelled" if reason == "abort" else "completed"
            return status, usage, reason
        raise EngineError("engine stream ended early", retryable=True, status=502)

    def _send(self, request: m.InferenceRequest, event: m.StreamEvent) -> None:
        """Queue `event` for its gateway; everything queued in this loop pass leaves as one message.

        One engine step yields a token for every running stream; batching them per gateway sends
        one NATS message per step instead of one per stream, at no added latency.
        """
        box = self._outbox.get(request.reply_to)
        if box is None:
            self._outbox[request.reply_to] = [event]
        else:
            box.append(event)
        if not self._outbox_flush_scheduled:
            self._outbox_flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_outbox)

    def _flush_outbox(self) -> None:
        self._outbox_flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        self._spawn(self._publish_batches(outbox))

    async def _publish_batches(self, outbox: dict[str, list[m.StreamEvent]]) -> None:
        assert self.nc is not None
        for subject, events in outbox.items():
            try:
                await self.nc.publish(subject, m.encode(m.StreamBatch(events=events)))
            except Exception as error:  # a gateway's events must not be lost to another's failure
                log.error("stream_publish_failed", subject=subject, error=repr(error))

    async def _publish_usage(self, request: m.InferenceRequest, status: str, usage: m.Usage, finish: str | None) -> None:
        assert self.replies is not None
        event = m.UsageEvent(
            request_id=request.request_id, tenant=request.tenant, model=request.model, adapter=request.adapter,
            tier=request.tier, status=status, usage=usage, started=request.created, finished=time.time(),  # type: ignore[arg-type]
            worker_id=self.settings.worker_id, attempts=request.attempt + 1, finish_reason=finish,
            api_key_id=request.api_key_id, batch_id=request.batch_id,
        )
        try:
            await self.replies.publish_durable(subjects.usage_subject(request.tenant), m.encode(event), request.request_id)
        except Exception as error:
            # JetStream is the ledger of record: say loudly that this request's usage is missing.
            log.error("usage_publish_failed", request_id=request.request_id, error=repr(error), usage=msgspec.to_builtins(usage))

    # ---- control ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = _cancel_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        entry = self.running.get(cancel.request_id)
        if entry is None:
            self._remember_cancel(cancel.request_id)
        elif not entry.cancelled:
            entry.cancelled = True
            await self.engine.abort(entry.request.engine_rid())

    def _remember_cancel(self, request_id: str) -> None:
        now = time.monotonic()
        self._cancelled[request_id] = now
        if len(self._cancelled) > CANCEL_MEMORY_SIZE:
            # Oldest first (dicts keep insertion order): forget what is past its deadline anyway.
            for old in list(self._cancelled)[: len(self._cancelled) // 2]:
                del self._cancelled[old]
        while self._cancelled:
            oldest, seen = next(iter(self._cancelled.items()))
            if now - seen < CANCEL_MEMORY_S:
                break
            del self._cancelled[oldest]

    async def _on_control(self, msg: Msg) -> None:
        try:
            command = msgspec.msgpack.decode(msg.data, type=m.ControlCommand)
        except msgspec.DecodeError:
            return
        if command.action == "drain":
            self._start_drain()
        elif command.action == "resync_cache" and self.cache_relay is not None:
            await self.cache_relay.publish_snapshot()
        elif command.action == "load_adapter" and command.adapter:
            try:
                await self.adapters.ensure(command.adapter)
            except EngineError as error:
                log.warning("adapter_preload_failed", adapter=command.adapter, error=str(error))
        elif command.action == "unload_adapter" and command.adapter:
            await self.adapters.unload(command.adapter)

    async def _lookup_adapter(self, name: str) -> m.AdapterSpec | None:
        return await adapter_registry.get(self._adapter_kv, name)

    # ---- liveness and load -----------------------------------------------------------------

    async def _heartbeat(self) -> None:
        assert self.kv is not None and self.budget is not None
        beat = m.Heartbeat(
            worker_id=self.settings.worker_id, model=self.settings.model, engine_url=self.settings.engine_url,
            started=self.started, ts=time.time(), state="draining" if self.draining else "ready",
            max_running=self.budget.capacity, gpu=str(self._engine_info.get("gpu", "")),
            tp=int(self._engine_info.get("tp_size", 0) or 0),
            block_size=int(self._engine_info.get("page_size", 0) or 0),
            max_adapters=self._max_adapters(), adapters=self.adapters.names(),
        )
        await self.kv.put(subjects.worker_key(self.settings.worker_id), m.encode(beat))

    def _max_adapters(self) -> int:
        info = self._engine_info
        if not info.get("enable_lora"):
            return 0
        return int(info.get("max_loaded_loras") or info.get("max_loras_per_batch") or 0)

    def _queued_prefill_tokens(self) -> int:
        return sum(
            max(0, (entry.request.prompt_tokens or 0) + entry.request.resumed_tokens - entry.request.expected_cached_tokens)
            for entry in self.running.values() if not entry.prefilled
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self._heartbeat()
            except Exception as error:
                log.warning("heartbeat_failed", error=repr(error))

    async def _load_loop(self) -> None:
        assert self.nc is not None and self.budget is not None
        while True:
            # Every interval, and soon after a prefill finishes: the router weighs queued prefill,
            # and a report that still counts finished work sends the next request elsewhere.
            try:
                await asyncio.wait_for(self._load_changed.wait(), timeout=self.settings.load_interval_s)
                await asyncio.sleep(LOAD_REPORT_MIN_GAP_S)
            except asyncio.TimeoutError:
                pass
            self._load_changed.clear()
            try:
                load = await self.engine.loads()
            except Exception as error:
                log.warning("engine_load_failed", error=repr(error))
                continue
            self._load_seq += 1
            KV_USAGE.set(load.used_tokens / load.capacity_tokens if load.capacity_tokens else 0.0)
            snapshot = m.WorkerLoad(
                worker_id=self.settings.worker_id, model=self.settings.model, ts=time.time(), seq=self._load_seq,
                running=load.running, waiting=load.waiting, in_flight=len(self.running),
                max_running=self.budget.capacity, kv_used_tokens=load.used_tokens,
                kv_capacity_tokens=load.capacity_tokens, cache_hit_rate=load.cache_hit_rate, draining=self.draining,
                completed=self._completed, queued_prefill_tokens=self._queued_prefill_tokens(),
                adapters=self.adapters.names(), pulled_own=self._pulled_own,
            )
            await self.nc.publish(subjects.metrics_subject(self.settings.worker_id), m.encode(snapshot))


async def serve(settings: WorkerSettings) -> None:
    settings = settings.resolved()
    logs.configure("worker", settings.log_level)
    tracing.configure("worker", settings.otel_exporter)
    structlog.contextvars.bind_contextvars(worker_id=settings.worker_id)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    worker = Worker(settings)
    await worker.run_until_signalled()
