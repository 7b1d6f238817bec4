"""Worker: pulls requests by affinity, drives one engine, streams tokens back over NATS.

One worker per engine replica, built by job:

- `serving`: the serving loop (slots, pull consumers, one request's life on the engine);
- `batch_lines`: batch lines (pull room, preemption, one result or a requeue per attempt);
- `engine_watch`: engine down and back, pauses of this process (verify before pulling again);
- `reporting`: heartbeat and load reports; `liveness`: the heartbeat thread;
- `events_out`: stream events to gateways, coalesced; `usage`: the usage outbox;
- `cancels`: cancels for requests not held yet;
- this module: connecting, the phases (starting → warm → serving, drain, demote), bus setup and
  control commands.

Each part takes a Protocol of its own module (`serving.Served`, `reporting.Reported`, ...) that
names what it may use of the worker, not the `Worker` itself; what one part needs of another it
asks of the worker (`announce`, `engine_down`, `stop_pulling`, ...), which delegates.

`Worker.connect` returns a worker connected to NATS (so the autoscaler sees the replica while its
engine loads); `start` waits for the engine and serves (or stays warm).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue
from prometheus_client import start_http_server

from inferbus.bus import connection as bus
from inferbus.bus.replies import Replies
from inferbus.bus.security_events import answerable
from inferbus.runtime import logs, tracing
from inferbus.stores import adapters as adapter_registry
from proto import messages as m
from proto import subjects
from proto.bands import Band

from . import engine_image, release_check
from .adapters import Adapters
from .attempt import Attempt
from .batch_lines import BatchLines
from .cache_events import CacheRelay
from .cancels import CancelMemory
from .claims import Claims
from .decode_side import DecodeSide
from .engine import EngineClient, EngineError
from .engine_health import EngineHealth
from .engine_watch import EngineWatch
from .events_out import EventSender
from .fault_hold import FaultHold
from .gpu_death import GpuDeathDetector
from .liveness import LivenessThread, PauseDetector
from .metrics import FREE_SLOTS, RESENDS
from .preemption import PreemptionPolicy
from .prefill_side import PrefillSide
from .reporting import LoadReporter, ServingStats, engine_gpu
from .roles import bootstrap_address, resolve_role
from .serving import Serving, consumer_specs
from .settings import WorkerSettings
from .tasks import Background
from .usage import UsageReporter

log = logs.get(__name__)

ENGINE_LOAD_TIMEOUT_S = 600.0
_cancel_decoder = msgspec.msgpack.Decoder(m.Cancel)
_resend_decoder = msgspec.msgpack.Decoder(m.ResendRequest)


class Worker:
    def __init__(self, settings: WorkerSettings, *, engine: EngineClient, nc: Client, js: JetStreamContext,
                 kv: KeyValue, replies: Replies, usage: UsageReporter, liveness: LivenessThread,
                 pause: PauseDetector, adapter_kv: KeyValue, claims_kv: KeyValue) -> None:
        """Use `Worker.connect`."""
        self.settings = settings
        self.engine = engine
        self.nc, self.js, self.kv = nc, js, kv
        self.replies = replies
        self.usage = usage
        self.fault_hold = FaultHold(settings.fault_hold, settings.state_dir, settings.worker_id)
        self.liveness = liveness
        self.pause = pause
        self._adapter_kv = adapter_kv
        self.background = Background()  # usage and stream publishes in flight
        self.events = EventSender(nc, self.background, settings.frame_window_ms / 1000,
                                  settings.accepted_wait_ms / 1000, replay_keep_s=settings.replay_keep_s,
                                  worker_id=settings.worker_id)
        self.cancels = CancelMemory(time.monotonic)
        self.adapters = Adapters(engine, self._lookup_adapter, on_change=lambda: self.load_changed.set(),
                                 on_progress=lambda: self.gpu.progress())
        self.health = EngineHealth(time.monotonic)
        self.gpu = GpuDeathDetector(time.monotonic, hang_after_s=settings.engine_hang_after_s,
                                    down_after_s=settings.engine_dead_after_s, max_errors=settings.engine_max_errors)
        self.exit_code = 0  # non-zero: the process exits with it (gpu_death.EXIT_GPU_DEATH)
        self.stats = ServingStats()
        self.running: dict[str, Attempt] = {}
        self.serving: Serving | None = None  # once the engine is loaded and its capacity known
        self.cache_relay: CacheRelay | None = None  # with INFERBUS_ENGINE_KV_EVENTS
        self.engine_info: dict[str, Any] = {}
        # Prefill/decode disaggregation (INFERBUS_WORKER_ROLE, the engine's --disaggregation-mode):
        # a prefill worker computes decode workers' prompts (`prefill`); a decode worker has its
        # requests' prompts computed by prefill workers (`decode`).
        self.role = "aggregated"
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.kv_capacity_tokens = 0  # its engine's KV cache, from the last load poll
        self.release: m.Release | None = None  # verified at start (INFERBUS_WORKER_RELEASE); None: unpinned
        self.release_counts = release_check.ReleaseCounters(None)
        self.adapter_outcomes = release_check.AdapterOutcomes()  # adapters with a canary: per version
        # Autoscaling: "starting" (engine loading), "warm" (loaded, pulls nothing until promoted) or
        # "serving". A demoted worker drains its work, then goes back to warm.
        self.phase = "starting"
        self.draining = False
        self.leaving = False  # drain (SIGTERM / control) in progress: the worker exits after it
        self.started = time.time()
        self.claims = Claims(claims_kv, kv, settings.worker_id, self.started)  # one run per attempt delivered
        self.wake = asyncio.Event()  # slots or the engine came back: the pull loop looks again
        self.load_changed = asyncio.Event()  # report load soon, not at the next interval
        self._preloads: set[asyncio.Future[None]] = set()  # adapter loads the routers asked for
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._serving_tasks: list[asyncio.Task[None]] = []
        self._drain_task: asyncio.Task[None] | None = None
        self._phase_change: asyncio.Future[None] | None = None
        # The parts last: mypy checks this worker against each part's Protocol here, with every
        # attribute's type known.
        self.watch = EngineWatch(self)
        self.reporter = LoadReporter(self)

    @classmethod
    async def connect(cls, settings: WorkerSettings) -> Worker:
        """A worker connected to NATS and answering control commands, its engine still loading:
        the bus first, so that the autoscaler sees this replica while its engine loads."""
        s = settings
        engine = EngineClient(s.engine_url)
        await engine.start()
        worker: Worker | None = None

        async def on_reconnect() -> None:
            if worker is not None:
                await worker._on_reconnect()

        nc = await bus.connect(s.nats_url, name=f"worker-{s.worker_id}", on_reconnect=on_reconnect)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        kv = await bus.workers_bucket(js, s.heartbeat_ttl_s)
        replies = Replies(nc)
        await replies.start()
        # Usage events wait on disk until JetStream acknowledges them (what a previous run left is
        # published now).
        usage = await UsageReporter.open(s.state_dir, s.worker_id, replies)
        pause = PauseDetector(time.monotonic, pause_after_s=s.heartbeat_ttl_s)
        liveness = LivenessThread(s.nats_url, s.worker_id, interval_s=s.heartbeat_interval_s, ttl_s=s.heartbeat_ttl_s,
                                  stall_after_s=s.stall_after_s, loop_lag=pause.lag)
        await asyncio.to_thread(liveness.start)
        adapter_kv = await adapter_registry.bucket(js)
        claims_kv = await bus.claims_bucket(js, s.claim_ttl_s)
        worker = cls(s, engine=engine, nc=nc, js=js, kv=kv, replies=replies, usage=usage, liveness=liveness,
                     pause=pause, adapter_kv=adapter_kv, claims_kv=claims_kv)
        # Control first: the router asks a worker for its cache as soon as its heartbeat appears.
        await nc.subscribe(subjects.control_subject(s.worker_id), cb=worker._on_control)
        worker._tasks = [asyncio.create_task(worker.reporter.load_loop(), name="load"),
                         asyncio.create_task(worker.watch.tick_loop(), name="tick")]
        return worker

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait for the engine to load, then serve (or stay warm: INFERBUS_WORKER_STANDBY)."""
        s = self.settings
        if s.sim_cold_start_s:
            log.info("worker_simulated_cold_start", seconds=s.sim_cold_start_s)
            await asyncio.sleep(s.sim_cold_start_s)
        await self._wait_for_engine()
        self.engine_info = await self.engine.server_info()
        try:
            self.role = resolve_role(s.role, self.engine_info)
        except ValueError as error:
            raise SystemExit(f"worker: {error}") from None
        self.engine.disaggregated = self.role != "aggregated"
        if s.engine_image_check not in ("auto", "kubernetes", "off"):
            raise SystemExit("worker: INFERBUS_ENGINE_IMAGE_CHECK must be auto, kubernetes or off, "
                             f"not {s.engine_image_check!r}")
        access = engine_image.pod_access(s.k8s_api_url, s.pod_name, s.pod_namespace)
        self.release = await release_check.verify_at_start(
            self.js, s.release, s.model, s.model_dir, self.engine_info,
            lambda image: engine_image.check(s.engine_image_check, image, s.engine_container, access))
        self.release_counts = release_check.ReleaseCounters(self.release)
        self.usage.release = self.release_counts.release_id
        if self.release is not None:
            structlog.contextvars.bind_contextvars(release=self.release.id)
        try:
            capacity = s.max_running or engine_max_running(self.engine_info)
        except EngineError as error:
            raise SystemExit(f"worker: {error}; set INFERBUS_WORKER_MAX_RUNNING") from None
        # The step-time cap on batch lines is the engine's own GPU's and TP's.
        preemption = PreemptionPolicy(s.preemption().for_engine(*engine_gpu(self.engine_info)),
                                      engine_priority=s.engine_has_priority(self.engine_info))
        self.serving = Serving(self, capacity, preemption, lambda serving: BatchLines(self, serving))
        FREE_SLOTS.set(capacity)
        if self.role == "prefill":
            self.prefill = PrefillSide(self, capacity, bootstrap_address(self.engine_info, s.engine_url,
                                                                         s.engine_bootstrap_host))
            await self.prefill.start()
        elif self.role == "decode":
            self.decode = DecodeSide(self)
            await self.decode.start()
        if s.engine_kv_events:
            self.cache_relay = CacheRelay(self.nc, s.worker_id, s.engine_kv_events, block_size=s.block_size,
                                          bind=s.engine_kv_events_bind)
            self.cache_relay.start()
        await self.nc.subscribe(subjects.cancel_wildcard(), cb=self._on_cancel)
        await self.nc.subscribe(subjects.resend_worker_subjects(s.worker_id), cb=self._on_resend)
        await self.nc.subscribe(subjects.holder_wildcard(), cb=self._on_holder)
        if s.standby:
            await self.setup_bus()
            self.phase = "warm"
            self.load_changed.set()
            log.info("worker_warm", worker_id=s.worker_id, engine=s.engine_url, capacity=capacity, bands=s.band_list())
            return
        await self._begin_serving(self.serving)

    async def _begin_serving(self, serving: Serving) -> None:
        """Start pulling: at start-up, or when the autoscaler promotes this warm worker."""
        s = self.settings
        self.phase, self.draining = "serving", False
        await self.setup_bus()  # a router may have deleted our consumers while we were warm
        for puller in serving.pullers:
            await puller.start()
        self._serving_tasks = [
            asyncio.create_task(serving.pull_loop(), name="pull"),
            asyncio.create_task(serving.look_loop(), name="look"),
            asyncio.create_task(self.reporter.heartbeat_loop(), name="heartbeat"),
        ]
        self.load_changed.set()
        log.info("worker_ready", worker_id=s.worker_id, engine=s.engine_url, capacity=serving.capacity,
                 bands=self.bands(), engine_priority=serving.preemption.engine_priority, zone=s.zone, role=self.role)

    async def _wait_for_engine(self) -> None:
        deadline = time.monotonic() + ENGINE_LOAD_TIMEOUT_S
        while not await self.engine.ready():
            if time.monotonic() > deadline:
                raise SystemExit(f"engine at {self.settings.engine_url} not ready after {ENGINE_LOAD_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.2)

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.start_drain)
        # A signal may come while the engine still loads (a scale-down of a starting replica).
        starting = asyncio.ensure_future(self.start())
        stopped = asyncio.ensure_future(self._stopped.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
        elif not starting.cancelled():
            starting.result()  # start-up failures end the worker with their message
        await stopped

    def start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stop pulling, let in-flight requests finish for a while, hand the rest back, leave."""
        if self.leaving:
            return
        self.leaving = True
        self.draining = True
        log.info("worker_draining", in_flight=len(self.running), phase=self.phase)
        await self.stop_pulling()
        if self.phase == "serving":
            await self.reporter.heartbeat()
        else:
            await self.reporter.publish_idle()  # says draining: the autoscaler stops counting it as warm
        await self._finish_in_flight()
        await self.stop()

    # ---- what the parts ask of the worker ---------------------------------------------------
    # Each part (serving, reporting, engine_watch, gpu_death, prefill_side, decode_side) names in a
    # Protocol of its own module what it may use of the worker; these say what a part means instead
    # of reaching into another part.

    async def stop_pulling(self) -> None:
        if self.serving is not None:
            for puller in self.serving.pullers:
                await puller.stop()

    def forget_pulls(self) -> None:
        """Pull requests made before a pause or a reconnect may be gone from the server."""
        if self.serving is not None:
            for puller in self.serving.pullers:
                puller.forget_pulls()

    async def announce(self) -> None:
        """Put the heartbeat now, if serving (`LoadReporter.publish_heartbeat`)."""
        await self.reporter.publish_heartbeat()

    def refresh_beat(self) -> None:
        """The liveness thread keeps putting the heartbeat as it is now."""
        self.liveness.set_beat(self.reporter.beat())

    def engine_down(self, why: str) -> None:
        self.watch.down(why)

    def verify_soon(self, why: str) -> None:
        self.watch.verify_soon(why)

    def note_tick(self) -> None:
        """The loop runs (a token arrived): a gap since the last tick was a pause of this process."""
        self.watch.tick()

    def pulls_held(self) -> bool:
        """Verifying engine and consumers after a pause: pull nothing, say draining."""
        return self.watch.holding_pulls

    def relearn_bootstrap(self) -> None:
        """A new prefill engine may serve its bootstrap server on another port."""
        if self.prefill is not None:
            s = self.settings
            self.prefill.bootstrap_host, self.prefill.bootstrap_port = bootstrap_address(
                self.engine_info, s.engine_url, s.engine_bootstrap_host)

    def bands(self) -> list[Band]:
        """The bands this worker pulls: none for a prefill worker (decode workers send it work)."""
        return [] if self.role == "prefill" else self.settings.band_list()

    async def _finish_in_flight(self) -> None:
        # Batch lines go back to the queue now, with their progress: they resume on another
        # worker instead of holding this one up to the drain timeout.
        if self.serving is not None:
            for entry in list(self.running.values()):
                if entry.preemptible:
                    await self.serving.batch.preempt(entry, "drain")
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for entry in list(self.running.values()):
            entry.handed_off = True
            await self.engine.abort(entry.request.engine_rid())
        while self.running:
            await asyncio.sleep(0.01)
        if self.prefill is not None:
            await self.prefill.finish(max(0.0, deadline - time.monotonic()))

    async def promote(self) -> None:
        """Warm → serving: the autoscaler's fast path (seconds, not a cold start)."""
        if self.phase != "warm" or self.leaving or self.serving is None:
            return
        log.info("worker_promoted", wake_s=self.settings.sim_warm_start_s)
        if self.settings.sim_warm_start_s:
            await asyncio.sleep(self.settings.sim_warm_start_s)
        if self.phase == "warm" and not self.leaving:
            await self._begin_serving(self.serving)

    async def demote(self) -> None:
        """Serving → warm: stop pulling, finish (or hand back) in-flight work, leave the registry,
        keep the engine loaded. Routers see `draining` at once and place nothing more here."""
        if self.phase != "serving" or self.draining:
            return
        self.draining = True
        log.info("worker_demoting", in_flight=len(self.running))
        await self.stop_pulling()
        await self.reporter.heartbeat()
        self.load_changed.set()
        await self._finish_in_flight()
        if self.leaving:
            return  # a drain started meanwhile; it ends the worker
        for task in self._serving_tasks:
            task.cancel()
        self._serving_tasks = []
        self.liveness.set_beat(None)
        await self._leave_registry()
        self.phase, self.draining = "warm", False
        self.load_changed.set()
        log.info("worker_warm", worker_id=self.settings.worker_id, demoted=True)

    async def _leave_registry(self) -> None:
        try:
            await self.kv.delete(subjects.worker_key(self.settings.worker_id))
        except Exception as error:
            log.warning("heartbeat_delete_failed", error=repr(error))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._serving_tasks]:
            task.cancel()
        self.watch.stop()
        if self.decode is not None:
            await self.decode.stop()
        self.events.flush()  # stream events waiting for their frame window leave now
        await self.background.wait(timeout=10)  # usage events are the billing ledger: let them reach the outbox
        await self.usage.close()  # and JetStream, if it answers; what does not stays on disk
        await asyncio.to_thread(self.liveness.stop)
        await self._leave_registry()
        if self.cache_relay is not None:
            await self.cache_relay.stop()
        self.events.flush()
        await self.background.wait(timeout=1)
        await self.nc.drain()
        await self.engine.close()
        log.info("worker_stopped")
        self._stopped.set()

    # ---- the bus ---------------------------------------------------------------------------

    async def setup_bus(self) -> None:
        """Streams, the heartbeat bucket and this worker's consumers; idempotent, so a worker can
        run it again after a reconnect to a server that lost them."""
        await bus.ensure_streams(self.js)
        self.kv = await bus.workers_bucket(self.js, self.settings.heartbeat_ttl_s)
        await bus.claims_bucket(self.js, self.settings.claim_ttl_s)  # a server that lost it gets it back
        if self.phase != "serving":
            return  # warm workers are in no registry and own no queue
        # Heartbeat before the consumers exist: a router never sees a queue without its worker.
        await self.reporter.heartbeat()
        for band, owner in consumer_specs(self.bands(), self.settings.worker_id):
            await self._ensure_consumer(band, owner)

    async def _ensure_consumer(self, band: str, owner: str | None) -> None:
        name = subjects.request_consumer(band, self.settings.model, owner)  # type: ignore[arg-type]
        target = subjects.ANY_TARGET if owner is None else subjects.worker_target(owner)
        config = ConsumerConfig(
            durable_name=name,
            filter_subject=subjects.request_filter(band, self.settings.model, target),  # type: ignore[arg-type]
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

    async def _on_reconnect(self) -> None:
        if self.serving is None:
            return  # still starting: start() sets the bus up once the engine is loaded
        await bus.retry_forever("bus setup after reconnect", self.setup_bus)
        self.forget_pulls()  # the server may have lost our pull requests

    # ---- control ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = _cancel_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        owner = subjects.cancel_owner(msg.subject)
        if self.prefill is not None:
            await self.prefill.on_cancel(cancel, owner)
        entry = self.running.get(cancel.request_id)
        if entry is not None and subjects.reply_owner(entry.request.reply_to) != owner:
            # Only the gateway holding the client may cancel its request (each gateway's NATS
            # permissions allow its own cancel subjects only; this holds where identities are shared).
            log.warning("cancel_not_owner", request_id=cancel.request_id, cancel_subject=msg.subject)
            return
        if cancel.attempt >= 0:  # one attempt, given up by its gateway
            if entry is None or entry.request.attempt != cancel.attempt:
                self.cancels.supersede(cancel.request_id, cancel.attempt)
                return
            if not entry.cancelled and entry.request.batch_id is None:
                entry.cancelled = entry.superseded = True
                entry.cancel_reason = cancel.reason
                await self.engine.abort(entry.request.engine_rid())
            return
        if entry is None:
            self.cancels.remember(owner, cancel.request_id, cancel.reason)
        elif not entry.cancelled:
            entry.cancelled = True
            entry.cancel_reason = cancel.reason
            entry.delivered_tokens = cancel.delivered_tokens
            await self.engine.abort(entry.request.engine_rid())

    async def _on_resend(self, msg: Msg) -> None:
        """A gateway missed events of a stream it knows this worker runs: send them again from what
        the replay log kept."""
        await self._resend(msg, holder_only=False)

    async def _on_holder(self, msg: Msg) -> None:
        """The same question asked of every worker (the gateway does not know which one took the
        request): only the holder answers."""
        await self._resend(msg, holder_only=True)

    async def _resend(self, msg: Msg, holder_only: bool) -> None:
        try:
            ask = _resend_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        owner = subjects.resend_owner(msg.subject)
        entry = self.running.get(ask.request_id)
        running = (entry is not None and entry.request.attempt == ask.attempt
                   and subjects.reply_owner(entry.request.reply_to) == owner)
        state, subject, events = self.events.replay.since(ask.request_id, ask.attempt, ask.from_seq, owner=owner,
                                                           running=running)
        if state == "unknown" and holder_only:
            return
        if events and state != "unknown":
            self.events.resend(subject, events)
        RESENDS.labels(state).inc()
        if events or state == "unknown":
            log.warning("stream_resent", request_id=ask.request_id, attempt=ask.attempt, from_seq=ask.from_seq,
                        state=state, resent=len(events))
        if answerable(msg):
            resent = len(events) if state != "unknown" else 0
            await msg.respond(m.encode(m.ResendReply(state=state, resent=resent, worker_id=self.settings.worker_id)))

    async def _on_control(self, msg: Msg) -> None:
        try:
            command = msgspec.msgpack.decode(msg.data, type=m.ControlCommand)
        except msgspec.DecodeError:
            return
        if command.action == "drain":
            self.start_drain()
        elif command.action in ("promote", "demote"):
            if self._phase_change is None or self._phase_change.done():
                work = self.promote() if command.action == "promote" else self.demote()
                self._phase_change = asyncio.ensure_future(work)
        elif command.action == "resync_cache" and self.cache_relay is not None:
            await self.cache_relay.publish_snapshot()
        elif command.action == "load_adapter" and command.adapter:
            # In the background: a load takes a while, and other commands (a drain) must not wait for it.
            task = asyncio.ensure_future(self._preload_adapter(command.adapter, command.background))
            self._preloads.add(task)
            task.add_done_callback(self._preloads.discard)
        elif command.action == "unload_adapter" and command.adapter:
            await self.adapters.unload(command.adapter)

    async def _preload_adapter(self, engine_name: str, background: bool) -> None:
        try:
            await self.adapters.ensure(engine_name, background=background)
        except EngineError as error:
            log.warning("adapter_preload_failed", adapter=engine_name, error=str(error))

    async def _lookup_adapter(self, name: str) -> m.AdapterSpec | None:
        return await adapter_registry.get(self._adapter_kv, name)


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
    # A signal while connecting (NATS not up yet) ends the worker before it holds anything.
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    connecting = asyncio.ensure_future(Worker.connect(settings))
    stopping = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        log.info("worker_stopped", while_="connecting")
        return
    worker = connecting.result()
    if stop_requested.is_set():
        worker.start_drain()
    await worker.run_until_signalled()
    if worker.exit_code:
        raise SystemExit(worker.exit_code)
