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
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
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
from inferbus.outbox import Outbox
from inferbus.replies import Replies
from proto import messages as m
from proto import subjects

from .adapters import Adapters
from .cache_events import CacheRelay
from .engine import EngineClient, EngineError, EngineLoad, EngineUpdate
from .engine_health import EngineHealth
from .gpu_death import GpuDeathDetector, give_up
from .http import HTTPError
from .liveness import LivenessThread, PauseDetector
from .preemption import BatchRun, PreemptionPolicy
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
PREEMPTIONS = Counter("inferbus_worker_preemptions_total", "Batch lines preempted for waiting interactive work")
PAUSES = Counter("inferbus_worker_pauses_total", "Times this worker's event loop resumed after a pause (then it re-verified its engine and consumers)")
ABANDONED = Counter("inferbus_worker_abandoned_attempts_total", "Attempts this worker gave up or was told to give up, billed to the platform", ["reason"])
BATCH_REQUEUED = Counter(
    "inferbus_worker_batch_requeued_total", "Batch lines put back on the batch queue to resume elsewhere", ["reason"]
)
QUEUE_WAIT = Histogram(
    "inferbus_worker_queue_wait_seconds",
    "Gateway accept to engine submit",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

LOAD_REPORT_MIN_GAP_S = 0.02  # at most ~50 load reports a second, however busy
SCARCE_POLL_S = 0.05  # a consumer's turn when slots are scarce: a waiting request waits ≲ 4 turns
CANCEL_MEMORY_S = 900.0  # longer than a request may wait in the queue in practice
CANCEL_MEMORY_SIZE = 100_000
BATCH_POLL_S = 0.25  # a batch pull holds its slots at most this long, so interactive gets them back soon
TICK_S = 0.25  # the event loop's tick: a gap much longer than this means the worker was paused
SUPERSEDED_MEMORY_SIZE = 10_000
REQUEUE_TRIES = 5  # publish attempts for a requeued batch line (then the batch service's lease re-feeds it)
_request_decoder = msgspec.msgpack.Decoder(m.InferenceRequest)
_cancel_decoder = msgspec.msgpack.Decoder(m.Cancel)


def _cancel_key(owner: str, request_id: str) -> str:
    """A cancel that came before its request, remembered with the gateway that sent it."""
    return f"{owner} {request_id}"


@dataclass
class _Running:
    request: m.InferenceRequest
    task: asyncio.Task[None] | None = None  # held here: the event loop keeps only weak references
    cancelled: bool = False
    handed_off: bool = False
    prefilled: bool = False  # the engine has produced its first token
    first_token_at: float = 0.0
    started: float = field(default_factory=time.time)  # when this worker took it
    cancel_reason: str = ""
    superseded: bool = False  # the gateway gave this attempt up and continues elsewhere
    pause_epoch: int = 0  # the worker's pause count when it took the request
    # Batch lines only: progress of this attempt (totals include earlier attempts), and why the
    # line is being put back on the queue ("preempted", "drain", "engine_error"), if it is.
    requeue: str | None = None
    abort_resent: bool = False
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # batch lines: generated ids of this attempt
    completion: int = 0
    prompt_tokens: int | None = None
    cached: int = 0
    matched: str | None = None


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
    _cancelled: dict[str, tuple[float, str]] = field(default_factory=dict)  # id → (when, reason)
    _background: set[asyncio.Task[None]] = field(default_factory=set)  # usage publishes in flight
    _drain_task: asyncio.Task[None] | None = None
    _completed: int = 0  # requests finished, reported with load for the gateways' overload policy
    _outbox: dict[str, list[m.StreamEvent]] = field(default_factory=dict)
    _outbox_flush_scheduled: bool = False
    _load_changed: asyncio.Event = field(default_factory=asyncio.Event)
    _pulled_own: int = 0  # requests taken from this worker's own queue (routers compare with their placements)
    _own_target: str = ""
    adapters: Adapters = field(init=False)
    health: EngineHealth = field(default_factory=lambda: EngineHealth(time.monotonic))
    _engine_watch: asyncio.Task[None] | None = None
    cache_relay: CacheRelay | None = None
    # Autoscaling: "starting" (engine loading), "warm" (loaded, pulls nothing until promoted) or
    # "serving". A demoted worker drains its work, then goes back to warm.
    phase: str = "starting"
    _leaving: bool = False  # drain (SIGTERM / control) in progress: the worker exits after it
    _serving_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _phase_change: asyncio.Task[None] | None = None
    _batch_in_flight: int = 0
    _completed_batch: int = 0
    _ttft_hist: list[int] = field(default_factory=list)  # cumulative, interactive only (see WorkerLoad)
    _queue_wait_hist: list[int] = field(default_factory=list)
    _tpot_hist: list[int] = field(default_factory=list)
    preemption: PreemptionPolicy = field(init=False)
    _batch_pullers: list[Puller] = field(default_factory=list)
    _interactive_consumers: list[str] = field(default_factory=list)  # polled for waiting work while batch runs
    _interactive_waiting: int = 0  # interactive requests seen waiting at the last check: no batch pulls meanwhile
    _interactive_stalled: int = 0  # interactive requests the engine kept waiting at the last check: no batch pulls meanwhile
    pause: PauseDetector = field(init=False)
    liveness: LivenessThread | None = None
    outbox: Outbox | None = None
    _superseded: dict[tuple[str, int], None] = field(default_factory=dict)  # attempts given up before we pulled them
    _verifying: asyncio.Task[None] | None = None
    _holding_pulls: bool = False  # verifying engine and consumers: pull nothing until done
    gpu: GpuDeathDetector = field(init=False)
    exit_code: int = 0  # non-zero: the process exits with it (gpu_death.EXIT_GPU_DEATH)
    _giving_up: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.engine = EngineClient(self.settings.engine_url)
        self.preemption = PreemptionPolicy(self.settings.preemption())
        self._own_target = "." + subjects.worker_target(self.settings.worker_id)
        self.adapters = Adapters(self.engine, self._lookup_adapter)
        self.pause = PauseDetector(time.monotonic, pause_after_s=self.settings.heartbeat_ttl_s)
        self.gpu = GpuDeathDetector(time.monotonic, hang_after_s=self.settings.engine_hang_after_s,
                                    down_after_s=self.settings.engine_dead_after_s,
                                    max_errors=self.settings.engine_max_errors)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        await self.engine.start()
        # The bus first, so that the autoscaler sees this replica while its engine loads.
        self.nc = await bus.connect(s.nats_url, name=f"worker-{s.worker_id}", on_reconnect=self._on_reconnect)
        self.js = self.nc.jetstream()
        self.replies = Replies(self.nc)
        await self.replies.start()
        # Usage events wait on disk until JetStream acknowledges them (what a previous run left is
        # published now).
        self.outbox = Outbox(Path(s.state_dir) / f"usage-outbox-{s.worker_id}.sqlite3", self._publish_durable)
        await self.outbox.start()
        self.liveness = LivenessThread(s.nats_url, s.worker_id, interval_s=s.heartbeat_interval_s, ttl_s=s.heartbeat_ttl_s,
                                       stall_after_s=s.stall_after_s, loop_lag=self.pause.lag)
        await asyncio.to_thread(self.liveness.start)
        self._adapter_kv = await adapter_registry.bucket(self.js)
        # Control first: the router asks a worker for its cache as soon as its heartbeat appears.
        await self.nc.subscribe(subjects.control_subject(s.worker_id), cb=self._on_control)
        self._tasks = [asyncio.create_task(self._load_loop(), name="load"),
                       asyncio.create_task(self._tick_loop(), name="tick")]
        if s.sim_cold_start_s:
            log.info("worker_simulated_cold_start", seconds=s.sim_cold_start_s)
            await asyncio.sleep(s.sim_cold_start_s)
        await self._wait_for_engine()
        self._engine_info = await self.engine.server_info()
        self.preemption = PreemptionPolicy(s.preemption(), engine_priority=s.engine_has_priority(self._engine_info))
        try:
            capacity = s.max_running or engine_max_running(self._engine_info)
        except EngineError as error:
            raise SystemExit(f"worker: {error}; set INFERBUS_WORKER_MAX_RUNNING") from None
        tiers = s.tier_list()
        self.budget = SlotBudget(capacity, pullers=len(self._consumer_specs()))
        FREE_SLOTS.set(capacity)
        if s.engine_kv_events:
            self.cache_relay = CacheRelay(self.nc, s.worker_id, s.engine_kv_events, block_size=s.block_size,
                                          bind=s.engine_kv_events_bind)
            self.cache_relay.start()
        await self.nc.subscribe(subjects.cancel_wildcard(), cb=self._on_cancel)
        if s.standby:
            await self._setup_bus()
            self.phase = "warm"
            self._load_changed.set()
            log.info("worker_warm", worker_id=s.worker_id, engine=s.engine_url, capacity=capacity, tiers=tiers)
            return
        await self._begin_serving()

    async def _begin_serving(self) -> None:
        """Start pulling: at start-up, or when the autoscaler promotes this warm worker."""
        s = self.settings
        assert self.nc is not None and self.budget is not None
        self.phase, self.draining = "serving", False
        consumers = await self._setup_bus()  # a router may have deleted them while we were warm
        if not self._pullers:
            # Most important first: earlier pullers get slots first. Batch pullers take only what
            # the preemption policy grants, and hold it briefly when the batch queue is empty.
            for (tier, _owner), consumer in zip(self._consumer_specs(), consumers):
                batch = tier == "batch"
                puller = Puller(self.nc, subjects.REQUESTS_STREAM, consumer, self.budget, self._on_request,
                                wake=self._wake, expires_s=min(s.fetch_timeout_s, BATCH_POLL_S) if batch else s.fetch_timeout_s,
                                room=self._batch_room if batch else None, on_consumer_gone=self.verify_soon)
                self._pullers.append(puller)
                if batch:
                    self._batch_pullers.append(puller)
                else:
                    self._interactive_consumers.append(consumer)
        for puller in self._pullers:
            await puller.start()
        self._serving_tasks = [
            asyncio.create_task(self._pull_loop(), name="pull"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        self._load_changed.set()
        log.info("worker_ready", worker_id=s.worker_id, engine=s.engine_url, capacity=self.budget.capacity,
                 tiers=s.tier_list(), engine_priority=self.preemption.engine_priority)

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
        # A signal may come while the engine still loads (a scale-down of a starting replica).
        starting = asyncio.ensure_future(self.start())
        stopped = asyncio.ensure_future(self._stopped.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
        elif not starting.cancelled():
            starting.result()  # start-up failures end the worker with their message
        await stopped

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stop pulling, let in-flight requests finish for a while, hand the rest back, leave."""
        if self._leaving:
            return
        self._leaving = True
        self.draining = True
        log.info("worker_draining", in_flight=len(self.running), phase=self.phase)
        for puller in self._pullers:
            await puller.stop()
        if self.phase == "serving" and self.kv is not None:
            await self._heartbeat()
        elif self.nc is not None:
            await self._publish_idle_load()  # says draining: the autoscaler stops counting it as warm
        await self._finish_in_flight()
        await self.stop()

    async def _finish_in_flight(self) -> None:
        # Batch lines go back to the queue now, with their progress: they resume on another
        # worker instead of holding this one up to the drain timeout.
        for entry in list(self.running.values()):
            if self._preemptible(entry):
                await self._preempt(entry, "drain")
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for entry in list(self.running.values()):
            entry.handed_off = True
            await self.engine.abort(entry.request.engine_rid())
        while self.running:
            await asyncio.sleep(0.01)

    async def promote(self) -> None:
        """Warm → serving: the autoscaler's fast path (seconds, not a cold start)."""
        if self.phase != "warm" or self._leaving:
            return
        log.info("worker_promoted", wake_s=self.settings.sim_warm_start_s)
        if self.settings.sim_warm_start_s:
            await asyncio.sleep(self.settings.sim_warm_start_s)
        if self.phase == "warm" and not self._leaving:
            await self._begin_serving()

    async def demote(self) -> None:
        """Serving → warm: stop pulling, finish (or hand back) in-flight work, leave the registry,
        keep the engine loaded. Routers see `draining` at once and place nothing more here."""
        if self.phase != "serving" or self.draining:
            return
        self.draining = True
        log.info("worker_demoting", in_flight=len(self.running))
        for puller in self._pullers:
            await puller.stop()
        await self._heartbeat()
        self._load_changed.set()
        await self._finish_in_flight()
        if self._leaving:
            return  # a drain started meanwhile; it ends the worker
        for task in self._serving_tasks:
            task.cancel()
        self._serving_tasks = []
        if self.liveness is not None:
            self.liveness.set_beat(None)
        try:
            assert self.kv is not None
            await self.kv.delete(subjects.worker_key(self.settings.worker_id))
        except Exception as error:
            log.warning("heartbeat_delete_failed", error=repr(error))
        self.phase, self.draining = "warm", False
        self._load_changed.set()
        log.info("worker_warm", worker_id=self.settings.worker_id, demoted=True)

    async def stop(self) -> None:
        for task in [*self._tasks, *self._serving_tasks, *([self._engine_watch] if self._engine_watch else [])]:
            task.cancel()
        if self._background:  # usage events are the billing ledger: let them reach the outbox
            await asyncio.wait(self._background, timeout=10)
        if self.outbox is not None:  # and JetStream, if it answers; what does not stays on disk
            if not await self.outbox.drained(timeout=5):
                log.warning("usage_outbox_pending_at_exit", path=str(self.outbox.path))
            await self.outbox.stop()
        if self.liveness is not None:
            await asyncio.to_thread(self.liveness.stop)
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
        if self.phase != "serving":
            return []  # warm workers are in no registry and own no queue
        # Heartbeat before the consumers exist: a router never sees a queue without its worker.
        await self._heartbeat()
        return [await self._ensure_consumer(tier, owner) for tier, owner in self._consumer_specs()]

    def _consumer_specs(self) -> list[tuple[str, str | None]]:
        """(tier, owner) of each consumer this worker pulls, most important first. Batch lines are
        only ever queued on the shared subject, so the batch tier has no per-worker consumer."""
        return [
            (tier, owner)
            for tier in self.settings.tier_list()
            for owner in ((None,) if tier == "batch" else (self.settings.worker_id, None))
        ]

    async def _on_reconnect(self) -> None:
        if self.budget is None:
            return  # still starting: start() sets the bus up once the engine is loaded
        await bus.retry_forever("bus setup after reconnect", self._setup_bus)  # type: ignore[arg-type]
        for puller in self._pullers:  # the server may have lost our pull requests
            puller.forget_pulls()

    async def _pull_loop(self) -> None:
        assert self.budget is not None
        pullers = self._pullers
        turn = 0
        while not self.draining:
            self._wake.clear()
            if self._holding_pulls:
                await asyncio.sleep(SCARCE_POLL_S)
                continue
            if not self.health.up:
                # Its engine is down: a request taken now would fail at once and bounce between
                # workers. The engine watch wakes this loop when it is back.
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self.settings.fetch_timeout_s)
                except asyncio.TimeoutError:
                    pass
                continue
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
        if request.batch_id is not None and request.request_id in self.running:
            # Another attempt of a line this worker already runs (the batch service republished
            # it after a restart or a lapsed heartbeat): the running one will report the line.
            log.info("batch_duplicate_dropped", request_id=request.request_id, attempt=request.attempt)
            self._spawn(msg.ack())
            self._release_slot()
            return
        entry = _Running(request=request, pause_epoch=self.pause.epoch)
        self.running[request.request_id] = entry
        if request.tier == "batch":
            self._batch_in_flight += 1
        RUNNING.set(len(self.running))
        serve = self._serve_batch if request.batch_id is not None else self._serve
        entry.task = asyncio.ensure_future(serve(msg, entry))

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
            abandoned: str | None = None  # why this attempt's work is the platform's, not the tenant's
            try:
                await msg.ack()
                if (request.request_id, request.attempt) in self._superseded:
                    publish_usage = False  # the gateway moved on before this attempt started: no work done
                    return
                cancelled = self._cancelled.get(_cancel_key(subjects.reply_owner(request.reply_to), request.request_id))
                if cancelled is not None:
                    status, finish = "cancelled", "abort"
                    # After a deadline the gateway bills what the client got; otherwise nothing ran.
                    publish_usage = cancelled[1] != "deadline"
                    return
                if time.time() > request.deadline:
                    finish = "error"
                    self._send(request, m.StreamError(
                        request_id=request.request_id, attempt=request.attempt, code="timeout",
                        message="request deadline passed before a worker could start it", status=504,
                    ))
                    publish_usage = False  # nothing ran; the gateway bills what the client got
                    return
                queue_wait = max(0.0, time.time() - request.created)
                QUEUE_WAIT.observe(queue_wait)
                if request.tier != "batch" and request.attempt == 0:
                    m.observe(self._queue_wait_hist, m.LATENCY_BUCKETS_S, queue_wait)
                self._send(request, m.Accepted(
                    request_id=request.request_id, attempt=request.attempt,
                    worker_id=self.settings.worker_id, queue_wait=queue_wait,
                ))
                status, usage, finish = await self._generate(request, entry, trace_headers)
                if entry.handed_off:
                    abandoned = "handoff"  # the next attempt reports the client-visible totals
                    self._send(request, m.Handoff(
                        request_id=request.request_id, attempt=request.attempt, worker_id=self.settings.worker_id
                    ))
            except EngineError as error:
                ENGINE_ERRORS.inc()
                if error.status >= 500 and error.code not in ("worker_paused", "engine_unavailable"):
                    self.gpu.engine_error()
                log.warning("engine_error", code=error.code, error=str(error), retryable=error.retryable)
                # The gateway bills what the client received when a request ends in an error, and a
                # retryable one continues elsewhere: this attempt's work is the platform's.
                abandoned = error.code if error.code == "worker_paused" else "engine_error"
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
                abandoned = "internal_error"
            finally:
                self.running.pop(request.request_id, None)
                RUNNING.set(len(self.running))
                self._release_slot()
                self._completed += 1
                if request.tier == "batch":
                    self._batch_in_flight -= 1
                    self._completed_batch += 1
                else:
                    self._observe_tpot(entry, usage.completion_tokens - request.resumed_tokens)
                REQUESTS.labels(status).inc()
                structlog.contextvars.unbind_contextvars("request_id", "tenant")
                if entry.superseded or (entry.cancelled and entry.cancel_reason == "deadline"):
                    # The gateway gave this attempt up (and bills the tenant what the client got).
                    abandoned = abandoned or ("deadline" if entry.cancel_reason == "deadline" else "superseded")
                if abandoned is not None:
                    ABANDONED.labels(abandoned).inc()
                    if entry.prefilled or entry.completion > request.resumed_tokens:
                        self._spawn(self._publish_usage(request, status, self._attempt_work(entry), finish,
                                                        billed_to="platform"))
                elif publish_usage:
                    # Spawned, not awaited: this also runs after the early returns above.
                    self._spawn(self._publish_usage(request, status, usage, finish))

    async def _generate(
        self, request: m.InferenceRequest, entry: _Running, trace_headers: dict[str, str]
    ) -> tuple[str, m.Usage, str | None]:
        seq = 0
        completion = request.resumed_tokens
        prompt_tokens = request.prompt_tokens
        cached = 0
        batch = request.batch_id is not None
        update: EngineUpdate
        if request.adapter:
            await self.adapters.ensure(request.adapter)
        async for update in self._engine_stream(request, trace_headers):
            self.gpu.progress()
            if not entry.prefilled:
                entry.prefilled = True
                entry.first_token_at = time.time()
                if request.tier != "batch" and request.attempt == 0:  # a migration's TTFT is not the client's
                    m.observe(self._ttft_hist, m.LATENCY_BUCKETS_S, entry.first_token_at - request.created)
                self._load_changed.set()  # its prefill is done: tell the router now, not at the next tick
            completion = request.resumed_tokens + update.completion_tokens
            if prompt_tokens is None and update.prompt_tokens is not None:
                prompt_tokens = max(0, update.prompt_tokens - request.resumed_tokens)
            cached = min(update.cached_tokens, prompt_tokens or 0)
            entry.completion, entry.prompt_tokens, entry.cached = completion, prompt_tokens, cached
            if not batch:
                self._tick()
                if entry.pause_epoch != self.pause.epoch:
                    # This worker was stopped mid-stream, long enough to be declared dead: the
                    # gateway may already continue it elsewhere. Give it up, whichever it did;
                    # the client sees one stream either way.
                    await self.engine.abort(request.engine_rid())
                    raise EngineError("the worker was paused; continuing on another worker", code="worker_paused",
                                      retryable=True, status=503)
            if batch:  # no stream to a client: the line's text is kept for its one result
                entry.text_parts.append(update.text)
                entry.token_ids.extend(update.token_ids)
                if update.finish is None:
                    await self._batch_checkpoint(entry)
                    continue
            if update.finish is None:
                self._send(request, m.TokenChunk(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=update.text,
                    completion_tokens=completion, prompt_tokens=prompt_tokens if seq == 0 else None,
                    token_ids=update.token_ids, logprobs=update.logprobs,
                ))
                seq += 1
                continue
            finish_type = update.finish.get("type")
            reason: m.FinishReason = {"stop": "stop", "length": "length", "abort": "abort"}.get(finish_type, "stop")  # type: ignore[assignment]
            matched = update.finish.get("matched")
            usage = m.Usage(prompt_tokens=prompt_tokens or 0, completion_tokens=completion, cached_tokens=cached)
            entry.matched = matched if isinstance(matched, str) else None
            if not entry.handed_off and not batch:
                self._send(request, m.Final(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=update.text,
                    finish_reason=reason, usage=usage, matched_stop=matched if isinstance(matched, str) else None,
                    worker_id=self.settings.worker_id, token_ids=update.token_ids, logprobs=update.logprobs,
                ))
            status = "cancelled" if reason == "abort" else "completed"
            return status, usage, reason
        raise EngineError("engine stream ended early", retryable=True, status=502)

    async def _engine_stream(self, request: m.InferenceRequest, headers: dict[str, str]) -> AsyncIterator[EngineUpdate]:
        """The engine's stream for `request`. An adapter the engine says it never loaded (it restarted
        since) is loaded again and the request sent once more: the refusal comes before any token."""
        for attempt in (0, 1):
            try:
                async for update in self.engine.generate(request, headers):
                    yield update
                return
            except EngineError as error:
                if error.code == "engine_unavailable":
                    self._engine_down(str(error))
                if attempt or error.code != "adapter_not_loaded" or not request.adapter:
                    raise
                log.warning("adapter_lost_by_engine", adapter=request.adapter, error=str(error))
                self.adapters.forget(request.adapter)
                await self.adapters.ensure(request.adapter)

    # ---- engine down and back ---------------------------------------------------------------

    def _engine_down(self, why: str) -> None:
        """Stop pulling and say not ready until the engine answers again; probe it with backoff."""
        if not self.health.up:
            return
        self.health.failed()
        log.warning("engine_down", engine=self.settings.engine_url, why=why)
        self._spawn(self._publish_heartbeat())  # not ready: gateways and routers stop counting on it
        if self._engine_watch is None or self._engine_watch.done():
            self._engine_watch = asyncio.create_task(self._watch_engine(), name="engine-watch")

    async def _watch_engine(self) -> None:
        delay = self.health.first_delay_s
        while True:
            await asyncio.sleep(delay)
            if await self.engine.ready():
                break
            delay = self.health.failed()
            log.info("engine_probe_failed", engine=self.settings.engine_url, failures=self.health.failures,
                     retry_in_s=round(delay, 3))
        # It answers again, maybe as a new process: what this worker believed about it is stale.
        try:
            self._engine_info = await self.engine.server_info()
        except Exception as error:
            log.warning("engine_info_failed", error=repr(error))
        forgotten = self.adapters.forget_all()
        if self.cache_relay is not None:
            try:
                await self.cache_relay.engine_restarted()
            except Exception as error:  # the router's index ages stale blocks out regardless
                log.warning("cache_reset_failed", error=repr(error))
        self.health.recovered()
        log.info("engine_back", engine=self.settings.engine_url, adapters_forgotten=forgotten)
        await self._publish_heartbeat()
        self._wake.set()
        self._load_changed.set()

    async def _publish_heartbeat(self) -> None:
        if self.kv is None or self.budget is None or self.phase != "serving":
            return
        try:
            await self._heartbeat()
        except Exception as error:
            log.warning("heartbeat_failed", error=repr(error))

    # ---- batch lines -----------------------------------------------------------------------

    async def _serve_batch(self, msg: Msg, entry: _Running) -> None:
        """One attempt at a batch line. It ends with ONE durable `BatchLineResult` (then its usage
        event), or goes back to the batch queue as the next attempt with the progress so far
        (preemption, drain, retryable failure), in which case this attempt reports nothing."""
        request = entry.request
        entry.completion, entry.prompt_tokens = request.resumed_tokens, request.prompt_tokens
        structlog.contextvars.bind_contextvars(request_id=request.request_id, tenant=request.tenant)
        # A failure that ends the line: (code, message, status). A retryable one leaves `finish`
        # unset instead, and the line is requeued like any attempt that did not finish.
        failure: tuple[str, str, int] | None = None
        finish: str | None = None
        try:
            with tracing.span(tracer, "worker.generate", msg.headers) as trace_headers:
                try:
                    await msg.ack()
                    if _cancel_key(subjects.reply_owner(request.reply_to), request.request_id) in self._cancelled:
                        entry.cancelled = True
                    elif time.time() <= request.deadline:
                        queue_wait = max(0.0, time.time() - request.created)
                        QUEUE_WAIT.observe(queue_wait)
                        self._send(request, m.Accepted(
                            request_id=request.request_id, attempt=request.attempt,
                            worker_id=self.settings.worker_id, queue_wait=queue_wait,
                        ))
                        if entry.requeue is None and not entry.cancelled:  # else preempted before it started
                            _, _, finish = await self._generate(request, entry, trace_headers)
                except EngineError as error:
                    ENGINE_ERRORS.inc()
                    log.warning("engine_error", code=error.code, error=str(error), retryable=error.retryable)
                    if not error.retryable:
                        failure = (error.code, str(error), error.status)
                except Exception:  # a bug must not lose the line: it runs again elsewhere
                    log.exception("worker_request_failed")
            status, result, follow_up = self._batch_outcome(entry, finish, failure)
        finally:
            self.running.pop(request.request_id, None)
            RUNNING.set(len(self.running))
            self._release_slot()
            if request.tier == "batch":
                self._batch_in_flight -= 1
            structlog.contextvars.unbind_contextvars("request_id", "tenant")
        REQUESTS.labels(status).inc()
        if follow_up is not None:
            self._spawn(self._requeue(follow_up, entry))
            return
        assert result is not None
        self._completed += 1
        if request.tier == "batch":
            self._completed_batch += 1
        self._spawn(self._finish_batch(request, result, status, self._batch_usage(entry), result.finish_reason or "error"))

    def _batch_outcome(
        self, entry: _Running, finish: str | None, failure: tuple[str, str, int] | None
    ) -> tuple[str, m.BatchLineResult | None, m.InferenceRequest | None]:
        """(status, the line's result, or the next attempt to queue instead)."""
        request = entry.request
        now = time.time()
        if entry.cancelled:
            expired = entry.cancel_reason == "deadline" or now >= request.deadline
            failure = ("batch_expired", "The line did not finish before its batch's completion window expired.", 408) \
                if expired else ("batch_cancelled", "The batch was cancelled before this line finished.", 499)
            return "cancelled", self._batch_result(entry, now, failure=failure), None
        if failure is None and finish in ("stop", "length"):
            return "completed", self._batch_result(entry, now, finish=finish), None
        if failure is None:
            # Not finished: asked to give way (preempted, draining), the engine gave up on it
            # (an abort of its own), a retryable failure, or its deadline passed before it ran.
            reason = entry.requeue or ("drain" if entry.handed_off else "engine_error")
            if now >= request.deadline:
                failure = ("batch_expired", "The line did not finish before its batch's completion window expired.", 408)
            elif reason == "engine_error" and request.attempt + 1 >= self.preemption.config.max_attempts:
                failure = ("engine_error", f"The line failed on {request.attempt + 1} attempts.", 502)
            else:
                entry.requeue = reason
                if request.sampling.constrained:
                    # A grammar cannot continue from text: the next attempt starts the line over.
                    return "requeued", None, msgspec.structs.replace(
                        request, attempt=request.attempt + 1, resumed_text="", resumed_tokens=0,
                        prompt_tokens=entry.prompt_tokens, expected_cached_tokens=0,
                    )
                return "requeued", None, msgspec.structs.replace(
                    request, attempt=request.attempt + 1,
                    resumed_text=request.resumed_text + "".join(entry.text_parts),
                    # From ids when the engine reported the ids of all it generated, else from text.
                    **self._resume_from(request, entry),
                    resumed_tokens=entry.completion, prompt_tokens=entry.prompt_tokens, expected_cached_tokens=0,
                )
        return "failed", self._batch_result(entry, now, failure=failure), None

    @staticmethod
    def _resume_from(request: m.InferenceRequest, entry: _Running) -> dict[str, Any]:
        if request.input_ids and len(entry.token_ids) == entry.completion - request.resumed_tokens:
            return {"resumed_ids": request.resumed_ids + entry.token_ids}
        return {"input_ids": [], "resumed_ids": []}

    def _batch_result(self, entry: _Running, now: float, *, finish: str | None = None,
                      failure: tuple[str, str, int] | None = None) -> m.BatchLineResult:
        request = entry.request
        assert request.batch_id is not None
        result = m.BatchLineResult(
            batch_id=request.batch_id, line=request.batch_line, request_id=request.request_id,
            attempt=request.attempt, finished=now, worker_id=self.settings.worker_id,
        )
        if failure is None:
            result.text = request.resumed_text + "".join(entry.text_parts)
            result.finish_reason = finish
            result.matched_stop = entry.matched
            result.usage = self._batch_usage(entry)
        else:
            result.ok = False
            result.error_code, result.error_message, result.status = failure
            result.finish_reason = "abort" if failure[0] in ("batch_cancelled", "batch_expired") else "error"
            result.usage = self._batch_usage(entry)
        return result

    def _batch_usage(self, entry: _Running) -> m.Usage:
        """Tokens made for the line over all its attempts. Its prompt counts once some attempt ran
        it (earlier attempts report nothing: the attempt that ends the line reports the totals)."""
        ran = entry.prefilled or entry.request.resumed_tokens > 0
        return m.Usage(prompt_tokens=(entry.prompt_tokens or 0) if ran else 0, completion_tokens=entry.completion,
                       cached_tokens=entry.cached if ran else 0)

    async def _finish_batch(self, request: m.InferenceRequest, result: m.BatchLineResult, status: str,
                            usage: m.Usage, finish: str) -> None:
        """The result first, durably (the batch service keeps the first per line), then usage."""
        assert self.replies is not None and request.batch_id is not None
        subject = subjects.batch_result_subject(request.batch_id)
        for attempt in range(REQUEUE_TRIES):
            try:
                await self.replies.publish_durable(subject, m.encode(result), request.request_id)
                break
            except Exception as error:
                log.warning("batch_result_publish_failed", request_id=request.request_id, error=repr(error), try_=attempt + 1)
                await asyncio.sleep(0.2 * 2**attempt)
        else:
            # The batch service re-feeds a line without a result after its lease: it runs again.
            log.error("batch_result_lost", request_id=request.request_id)
        await self._publish_usage(request, status, usage, finish)

    async def _requeue(self, request: m.InferenceRequest, entry: _Running) -> None:
        """Queue the next attempt of a batch line on the shared batch subject, with its progress."""
        assert self.replies is not None
        reason = entry.requeue or "engine_error"
        subject = subjects.request_subject("batch", request.model, subjects.ANY_TARGET)
        msg_id = f"{request.request_id}.{request.attempt}"
        for attempt in range(REQUEUE_TRIES):
            try:
                await self.replies.publish_durable(subject, m.encode(request), msg_id, headers=tracing.inject())
                break
            except Exception as error:
                log.warning("batch_requeue_failed", request_id=request.request_id, error=repr(error), try_=attempt + 1)
                await asyncio.sleep(0.2 * 2**attempt)
        else:
            log.error("batch_line_not_requeued", request_id=request.request_id, attempt=request.attempt)
            return
        BATCH_REQUEUED.labels(reason).inc()
        log.info("batch_requeued", request_id=request.request_id, attempt=request.attempt, reason=reason,
                 tokens_carried=request.resumed_tokens)

    async def _batch_checkpoint(self, entry: _Running) -> None:
        """Between updates of a batch line: stop it once it was asked to give way or is past due."""
        if entry.requeue is None and not entry.cancelled and time.time() > entry.request.deadline:
            entry.cancelled, entry.cancel_reason = True, "deadline"
            await self.engine.abort(entry.request.engine_rid())
        elif (entry.requeue is not None or entry.cancelled) and not entry.abort_resent:
            # The first abort may have reached the engine before the request did: say it again.
            entry.abort_resent = True
            await self.engine.abort(entry.request.engine_rid())

    @staticmethod
    def _preemptible(entry: _Running) -> bool:
        return entry.request.batch_id is not None and entry.requeue is None and not entry.cancelled

    async def _preempt(self, entry: _Running, reason: str) -> None:
        request = entry.request
        entry.requeue = reason
        if reason == "preempted":
            PREEMPTIONS.inc()
        log.info("batch_preempted", request_id=request.request_id, attempt=request.attempt, reason=reason,
                 tokens_carried=entry.completion, context_tokens=(entry.prompt_tokens or 0) + entry.completion)
        await self.engine.abort(request.engine_rid())

    def _batch_reserved(self) -> int:
        return sum(puller.outstanding for puller in self._batch_pullers)

    def _batch_room(self) -> int:
        """Slots the batch pullers may reserve now (the Puller asks before every pull)."""
        if self.budget is None or self.draining or self._interactive_waiting:
            return 0
        interactive = len(self.running) - self._batch_in_flight
        reserved = self._batch_reserved()
        # Reserved slots become lines without a first token: they count as prefilling too.
        prefilling = self._batch_waiting() + reserved
        return self.preemption.batch_room(self.budget.capacity, interactive, self._batch_in_flight + reserved,
                                          batch_prefilling=prefilling, interactive_stalled=self._interactive_stalled)

    def _batch_waiting(self) -> int:
        """Batch lines this worker took that have no first token yet (queued in, or prefilled by, the engine)."""
        return sum(1 for e in self.running.values() if e.request.tier == "batch" and not e.prefilled)

    async def _check_preemption(self, load: EngineLoad) -> None:
        """Every load tick: preempt batch lines for interactive work waiting on the bus or (without
        engine priority; the policy decides) in the engine.

        The bus is asked (consumer info) only while batch lines run and fewer than `headroom`
        slots are free: otherwise waiting interactive work would find a slot anyway.
        """
        assert self.budget is not None
        config = self.preemption.config
        interactive = [e for e in self.running.values() if e.request.tier != "batch"]
        now = time.time()
        stalled = sum(1 for e in interactive if not e.prefilled and now - e.started > config.engine_wait_s)
        # Without engine priority, interactive work the engine keeps waiting blocks batch pulls until
        # the next check (a line preempted for it must not come straight back), with or without
        # batch lines running.
        self._interactive_stalled = min(load.waiting, stalled)
        candidates = [e for e in self.running.values() if self._preemptible(e)]
        if not candidates or self.draining:
            self._interactive_waiting = 0
            return
        # Slots reserved by batch pulls are not interactive's; lines already giving way are.
        capacity = self.budget.capacity - self._batch_reserved()
        free = capacity - len(interactive) - len(candidates)
        waiting = await self._interactive_pending() if free < config.headroom else 0
        self._interactive_waiting = waiting
        runs = [
            BatchRun(request_id=e.request.request_id, context_tokens=(e.prompt_tokens or 0) + e.completion,
                     generated=e.completion, started=e.started)
            for e in candidates
        ]
        for request_id in self.preemption.victims(capacity, len(interactive), waiting, runs,
                                                  engine_waiting=self._interactive_stalled):
            entry = self.running.get(request_id)
            if entry is not None and self._preemptible(entry):
                await self._preempt(entry, "preempted")

    async def _interactive_pending(self) -> int:
        """Interactive requests queued on this worker's consumers (its own and the shared ones)."""
        assert self.js is not None
        infos = await asyncio.gather(
            *(self.js.consumer_info(subjects.REQUESTS_STREAM, name, timeout=1.0) for name in self._interactive_consumers),
            return_exceptions=True,
        )
        pending = 0
        for info in infos:
            if isinstance(info, BaseException):
                log.warning("consumer_info_failed", error=repr(info))
                continue
            pending += info.num_pending or 0
        return pending

    def _observe_tpot(self, entry: _Running, tokens: int) -> None:
        if entry.first_token_at and tokens > 1:
            tpot = (time.time() - entry.first_token_at) / (tokens - 1)
            m.observe(self._tpot_hist, m.TPOT_BUCKETS_S, tpot)

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

    async def _publish_usage(self, request: m.InferenceRequest, status: str, usage: m.Usage, finish: str | None,
                             billed_to: str = "tenant") -> None:
        assert self.outbox is not None
        if request.choice and billed_to == "tenant":  # n > 1: the first choice bills the prompt
            usage = m.Usage(prompt_tokens=0, completion_tokens=usage.completion_tokens)
        event = m.UsageEvent(
            request_id=request.request_id, tenant=request.tenant, model=request.model, adapter=request.adapter,
            tier=request.tier, status=status, usage=usage, started=request.created, finished=time.time(),  # type: ignore[arg-type]
            worker_id=self.settings.worker_id, attempts=request.attempt + 1, finish_reason=finish,
            api_key_id=request.api_key_id, batch_id=request.batch_id, billed_to=billed_to,  # type: ignore[arg-type]
            attempt=request.attempt,
        )
        try:
            await self.outbox.add(subjects.usage_subject(request.tenant), m.encode(event), m.usage_msg_id(event))
        except Exception as error:
            # The disk refused it: the ledger will miss this event, so say so loudly.
            log.error("usage_outbox_write_failed", request_id=request.request_id, error=repr(error),
                      usage=msgspec.to_builtins(usage))

    async def _publish_durable(self, subject: str, data: bytes, msg_id: str) -> None:
        assert self.replies is not None
        await self.replies.publish_durable(subject, data, msg_id)

    @staticmethod
    def _attempt_work(entry: _Running) -> m.Usage:
        """What one attempt computed: its prefill (when it got that far) and the tokens it made."""
        request = entry.request
        prefilled = entry.prefilled or entry.completion > request.resumed_tokens
        return m.Usage(prompt_tokens=(entry.prompt_tokens or 0) + request.resumed_tokens if prefilled else 0,
                       completion_tokens=max(0, entry.completion - request.resumed_tokens),
                       cached_tokens=entry.cached if prefilled else 0)

    # ---- control ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = _cancel_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        owner = subjects.cancel_owner(msg.subject)
        entry = self.running.get(cancel.request_id)
        if entry is not None and subjects.reply_owner(entry.request.reply_to) != owner:
            # Only the gateway holding the client may cancel its request (each gateway's NATS
            # permissions allow its own cancel subjects only; this holds where identities are shared).
            log.warning("cancel_not_owner", request_id=cancel.request_id, cancel_subject=msg.subject)
            return
        if cancel.attempt >= 0:  # one attempt, given up by its gateway
            if entry is None or entry.request.attempt != cancel.attempt:
                self._superseded[(cancel.request_id, cancel.attempt)] = None
                while len(self._superseded) > SUPERSEDED_MEMORY_SIZE:
                    del self._superseded[next(iter(self._superseded))]
                return
            if not entry.cancelled and entry.request.batch_id is None:
                entry.cancelled = entry.superseded = True
                entry.cancel_reason = cancel.reason
                await self.engine.abort(entry.request.engine_rid())
            return
        if entry is None:
            self._remember_cancel(_cancel_key(owner, cancel.request_id), cancel.reason)
        elif not entry.cancelled:
            entry.cancelled = True
            entry.cancel_reason = cancel.reason
            await self.engine.abort(entry.request.engine_rid())

    def _remember_cancel(self, key: str, reason: str) -> None:
        now = time.monotonic()
        self._cancelled[key] = (now, reason)
        if len(self._cancelled) > CANCEL_MEMORY_SIZE:
            # Oldest first (dicts keep insertion order): forget what is past its deadline anyway.
            for old in list(self._cancelled)[: len(self._cancelled) // 2]:
                del self._cancelled[old]
        while self._cancelled:
            oldest, (seen, _) = next(iter(self._cancelled.items()))
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
        elif command.action in ("promote", "demote"):
            if self._phase_change is None or self._phase_change.done():
                work = self.promote() if command.action == "promote" else self.demote()
                self._phase_change = asyncio.ensure_future(work)
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
        assert self.kv is not None
        beat = self._beat()
        if self.liveness is not None:
            self.liveness.set_beat(beat)  # its thread keeps it fresh, whatever this loop is doing
        await self.kv.put(subjects.worker_key(self.settings.worker_id), m.encode(beat))

    def _beat(self) -> m.Heartbeat:
        assert self.budget is not None
        return m.Heartbeat(
            worker_id=self.settings.worker_id, model=self.settings.model, engine_url=self.settings.engine_url,
            # "starting" while the engine is down: alive, but not to be given requests.
            started=self.started, ts=time.time(),
            state="draining" if self.draining or self._holding_pulls else "ready" if self.health.up else "starting",
            max_running=self.budget.capacity, gpu=str(self._engine_info.get("gpu", "")),
            tp=int(self._engine_info.get("tp_size", 0) or 0),
            # The relay rebuilds the engine's pages into platform blocks: those are what the router indexes.
            block_size=self.settings.block_size if self.cache_relay is not None else 0,
            max_adapters=self._max_adapters(), adapters=self.adapters.names(), zone=self.settings.zone,
        )

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
        # The liveness thread puts the heartbeat; this loop keeps its copy current (state, adapters).
        assert self.liveness is not None
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            self.liveness.set_beat(self._beat())

    # ---- pauses: no zombie -------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._tick()
            reason = self.gpu.verdict(len(self.running), self.health.down_since) if self.phase == "serving" else None
            if reason is not None and not self._leaving:
                self._giving_up = asyncio.ensure_future(give_up(self, reason))

    def _tick(self) -> None:
        """Note that the loop runs; after a pause (SIGSTOP, a frozen host) verify before pulling."""
        if not self.pause.tick():
            return
        PAUSES.inc()
        log.warning("worker_resumed_after_pause", pauses=self.pause.epoch, in_flight=len(self.running))
        self.verify_soon("paused")

    def verify_soon(self, why: str) -> None:
        if self.phase != "serving" or self._leaving or (self._verifying is not None and not self._verifying.done()):
            return
        self._verifying = asyncio.ensure_future(self._verify(why))

    async def _verify(self, why: str) -> None:
        """After a pause or an engine failure: the engine answers, our consumers exist (a router
        deletes those of a worker it thought dead), our pull requests are live. Until then pull
        nothing: a request pulled into a broken worker would hang its client."""
        self._holding_pulls = True  # the heartbeat says "draining" meanwhile: nothing is placed here
        try:
            delay = 0.2
            while not await self.engine.ready():
                log.warning("engine_not_ready", why=why)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
            await bus.retry_forever("bus setup after a pause", self._setup_bus)  # type: ignore[arg-type]
        finally:
            self._holding_pulls = False
        for puller in self._pullers:  # pull requests made before the pause expired meanwhile
            puller.forget_pulls()
        self._wake.set()
        self._load_changed.set()
        log.info("worker_verified", why=why)

    async def _load_loop(self) -> None:
        assert self.nc is not None
        while True:
            # Every interval, and soon after a prefill finishes: the router weighs queued prefill,
            # and a report that still counts finished work sends the next request elsewhere.
            try:
                await asyncio.wait_for(self._load_changed.wait(), timeout=self.settings.load_interval_s)
                await asyncio.sleep(LOAD_REPORT_MIN_GAP_S)
            except asyncio.TimeoutError:
                pass
            self._load_changed.clear()
            if self.phase != "serving" or self.budget is None:
                await self._publish_idle_load()
                continue
            if not self.health.up:
                continue  # the engine watch probes it, with backoff
            try:
                load = await self.engine.loads()
            except Exception as error:
                if self.health.up:
                    log.warning("engine_load_failed", error=repr(error))
                if isinstance(error, HTTPError):
                    self._engine_down(f"load poll failed: {error!r}")
                self.verify_soon("engine_load_failed")
                continue
            try:
                await self._check_preemption(load)
            except Exception as error:  # the load report must go out regardless
                log.warning("preemption_check_failed", error=repr(error))
            self._load_seq += 1
            KV_USAGE.set(load.used_tokens / load.capacity_tokens if load.capacity_tokens else 0.0)
            snapshot = m.WorkerLoad(
                worker_id=self.settings.worker_id, model=self.settings.model, ts=time.time(), seq=self._load_seq,
                running=load.running, waiting=load.waiting, in_flight=len(self.running),
                max_running=self.budget.capacity, kv_used_tokens=load.used_tokens,
                kv_capacity_tokens=load.capacity_tokens, cache_hit_rate=load.cache_hit_rate, draining=self.draining,
                completed=self._completed, queued_prefill_tokens=self._queued_prefill_tokens(),
                adapters=self.adapters.names(), pulled_own=self._pulled_own, **self._autoscaling_fields(),
            )
            await self.nc.publish(subjects.metrics_subject(self.settings.worker_id), m.encode(snapshot))

    def _autoscaling_fields(self) -> dict[str, Any]:
        return dict(
            phase=self.phase, batch_in_flight=self._batch_in_flight, completed_batch=self._completed_batch,
            batch_waiting=self._batch_waiting(),
            ttft_hist=list(self._ttft_hist), queue_wait_hist=list(self._queue_wait_hist), tpot_fine_hist=list(self._tpot_hist),
        )

    async def _publish_idle_load(self) -> None:
        """A starting or warm worker offers no slots (max_running 0): gateways count none of it and
        routers, which know only registered workers, ignore it; the autoscaler counts it."""
        assert self.nc is not None
        self._load_seq += 1
        snapshot = m.WorkerLoad(
            worker_id=self.settings.worker_id, model=self.settings.model, ts=time.time(), seq=self._load_seq,
            running=0, waiting=0, in_flight=0, max_running=0, kv_used_tokens=0, kv_capacity_tokens=0,
            draining=self._leaving, completed=self._completed, pulled_own=self._pulled_own,
            **self._autoscaling_fields(),
        )
        try:
            await self.nc.publish(subjects.metrics_subject(self.settings.worker_id), m.encode(snapshot))
        except Exception as error:
            log.warning("load_publish_failed", error=repr(error))


def engine_max_running(info: dict[str, Any]) -> int:
    """Requests the engine runs at once, from its /server_info. SGLang reports the flag at the top
    (null unless --max-running-requests was given) and the effective value per data-parallel rank
    in `internal_states`; a worker that fell back to a guess would hold far fewer or more slots."""
    top = info.get("max_running_requests")
    if isinstance(top, int) and top > 0:
        return top
    states = info.get("internal_states") or []
    per_dp = [state.get("effective_max_running_requests_per_dp") for state in states if isinstance(state, dict)]
    effective = [value for value in per_dp if isinstance(value, int) and value > 0]
    if effective:
        return effective[0] * max(1, int(info.get("dp_size") or 1))
    raise EngineError("the engine's /server_info reports no max_running_requests (top level or internal_states)",
                      code="engine_info")


async def serve(settings: WorkerSettings) -> None:
    settings = settings.resolved()
    logs.configure("worker", settings.log_level)
    tracing.configure("worker", settings.otel_exporter)
    structlog.contextvars.bind_contextvars(worker_id=settings.worker_id)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    worker = Worker(settings)
    await worker.run_until_signalled()
    if worker.exit_code:
        raise SystemExit(worker.exit_code)
