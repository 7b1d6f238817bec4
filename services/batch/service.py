"""The batch service's shell: batch records in, lines fed to the fleet on spare capacity, results
collected, files written.

Everything it knows is rebuilt on start from durable stores: the `batches` KV (status, counts),
the `files` KV and the file store (input lines), and the `BATCH_RESULTS` stream (which lines
ended, how). Decisions are made by pure objects: `validate` (is the input file acceptable),
`FeedPolicy` (how many lines may be out now, from workers' load reports), `Tracker` (which lines,
fairly; which to publish again after a worker died or a lease ran out), `lines` (what a line's
request and output line look like), `lifecycle` (the status machine). Its parts take what they
need of it as a `typing.Protocol` of their own: `result_stream.ResultStream` (follow, judge, record
and read back the lines' results), `line_publishing.LinePublisher` (publish a line's attempt),
`finishing.Finisher` (the end: output and error files, the final record).

Life of a batch here: validating → (validate the file) → failed, or in_progress → (feed lines
while the policy allows; results come back) → finalizing → (write output and error files in input
order) → completed. At `expires_at`: in-flight lines are cancelled, what has no result goes to the
error file as `batch_expired`, status expired. `cancelling` (set by the gateway): the same with
`batch_cancelled`, status cancelled. Record writes are compare-and-set, so a gateway's cancel and
this service's progress updates never overwrite each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from collections.abc import Awaitable, Callable

import msgspec
import redis.asyncio as aioredis
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from prometheus_client import start_http_server

from inferbus.bus import connection as bus
from inferbus.bus import security_events
from inferbus.bus.replies import Replies
from inferbus.openai.errors import OpenAIError
from inferbus.runtime import logs, redis_conn
from inferbus.runtime.records import decode_or_none
from inferbus.stores import adapters as adapter_registry
from inferbus.stores import dispatch_records
from inferbus.stores.batches import BatchStore
from inferbus.stores.files import FileStore
from inferbus.stores.models import ModelCatalog
from inferbus.stores.tenants import TenantStore
from inferbus.tokens.prompt import ModelDirError, load_model
from proto import bands, subjects
from proto import messages as m

from . import lifecycle, requeue
from . import results as line_results
from .feed import FeedPolicy
from .finishing import Finisher
from .line_publishing import LinePublisher, read_bodies
from .metrics import BATCHES, FEED, FINISHED, LINES_OUT, LINES_WAITING
from .result_stream import ResultStream
from .settings import BatchSettings
from .tracker import ActiveBatch, Tracker, parse_request_id
from .validate import Limits, Validated, validate

log = logs.get(__name__)

_request_decoder = msgspec.msgpack.Decoder(m.InferenceRequest)
FOREIGN_REQUEUE = "foreign_requeue"  # a handed-back line that is not this service's to queue
_heartbeat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)
_load_decoder = msgspec.msgpack.Decoder(m.WorkerLoad)


class BatchService:
    def __init__(self, settings: BatchSettings) -> None:
        self.settings = settings
        self.id = settings.resolved_id()
        self.reply_subject = subjects.token_subject(f"batch-{self.id}")
        self.feed = FeedPolicy(time.monotonic, settings.feed_config())
        self.tracker = Tracker(settings.line_lease_s)
        self.limits = Limits(max_lines=settings.max_lines, max_bytes=settings.max_bytes, max_errors=settings.max_errors,
                             max_line_bytes=settings.max_line_bytes, max_json_depth=settings.max_json_depth)
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.replies: Replies | None = None
        self.batches: BatchStore | None = None
        self.files: FileStore | None = None
        self.tenants: TenantStore | None = None
        self.catalog = ModelCatalog(settings.model, int(time.time()))
        try:
            self.served = load_model(settings.model_dir)  # lines render exactly as the gateway renders requests
        except ModelDirError as error:
            raise SystemExit(f"batch: {error}") from None
        self.redis: aioredis.Redis | None = None
        self.live_workers: dict[str, str] = {}  # KV key → worker id
        self._gone: dict[str, float] = {}  # worker id → when its heartbeat ended (not back since)
        self._latest: dict[str, m.BatchRecord] = {}  # newest record seen per batch id
        self._busy: set[str] = set()  # batches with a transition in progress
        self._ended: set[str] = set()  # batches in a final status: nothing more to do for them
        self._tasks: list[asyncio.Task[None]] = []
        self._watches: list[asyncio.Task[None]] = []
        self._paused = False  # the feed policy's last verdict, logged when it changes
        self._background: set[asyncio.Task[None]] = set()
        self._watcher: KeyValue.KeyWatcher | None = None
        self.results = ResultStream(self)  # the batches' results: followed, judged, recorded, read back
        self.line_publisher = LinePublisher(self)
        self.finisher = Finisher(self)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self.nc = await bus.connect(s.nats_url, name=f"batch-{self.id}", on_reconnect=self._on_reconnect)
        self.js = self.nc.jetstream()
        js = self.js
        await bus.retry_forever("ensure_streams", lambda: bus.ensure_streams(js))
        batches_kv, files_kv = await bus.batch_buckets(js)
        await bus.dispatches_bucket(js)  # its lines' dispatch records (billing checks workers' usage)
        self.batches = BatchStore(batches_kv)
        self.files = FileStore(s.files_dir, files_kv, max_bytes=s.max_bytes)
        self.redis = redis_conn.async_client(s.redis_url)
        self.tenants = TenantStore(self.redis)
        await self.catalog.start(js)
        await self._adapters_loaded(js)
        self.replies = Replies(self.nc)
        await self.replies.start()
        await self.nc.subscribe(subjects.metrics_wildcard(), cb=self._on_load)
        await self.nc.subscribe(subjects.event_filter(f"batch-{self.id}"), cb=self._on_events,
                                pending_msgs_limit=1_000_000)
        await self.nc.subscribe(subjects.requeue_subject(f"batch-{self.id}"), cb=self._on_requeue)
        await self._watch()
        self._tasks = [
            asyncio.create_task(self._feed_loop(), name="feed"),
            asyncio.create_task(self._flush_loop(), name="flush"),
        ]
        log.info("batch_ready", service_id=self.id, reply_subject=self.reply_subject, model=s.model,
                 files_dir=s.files_dir, window_scale=s.window_scale)

    async def _watch(self) -> None:
        """(Re)start the watches: worker heartbeats and batch records."""
        assert self.js is not None
        for task in self._watches:
            task.cancel()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        workers = await bus.workers_bucket(self.js, self.settings.heartbeat_ttl_s)
        self._watcher = await workers.watchall()
        self._watches = [
            asyncio.create_task(bus.follow(self._watcher, self._on_heartbeat, self._on_worker_gone), name="workers"),
            asyncio.create_task(self._watch_batches(), name="batches"),
        ]

    async def _on_reconnect(self) -> None:
        # nats-py's ordered consumers (KV watches, result subscriptions) notice a restarted server
        # only after ~20 s of missed heartbeats; meanwhile nothing would finish. Start them again
        # now: the watches deliver every current value again, and result subscriptions replay
        # their batch's results (both handled idempotently).
        self._spawn(self._resubscribe(), "resubscribe")

    async def _resubscribe(self) -> None:
        assert self.js is not None
        for run, sender, result in self.tracker.lost_sight():
            await self.results.judge(run, sender, result)
        await bus.retry_forever("rewatch", self._watch)
        await bus.retry_forever("restart_catalog", self._restart_catalog)
        for run in self.tracker.batches():
            await self.results.unfollow(run.id)
            await bus.retry_forever("results", functools.partial(self.results.follow, run))
        log.info("resubscribed", batches=len(self.tracker.runs))

    async def _restart_catalog(self) -> None:
        assert self.js is not None
        await self.catalog.stop()
        await self.catalog.start(self.js)

    async def _adapters_loaded(self, js: JetStreamContext, timeout_s: float = 10.0) -> None:
        """Wait until the catalog holds every registered adapter: a batch for an adapter validated
        or resumed before the catalog has read it would fail as an unknown model."""
        try:
            expected = len(await (await adapter_registry.bucket(js)).keys())
        except Exception:  # no adapters registered (NoKeysError), or no bucket yet
            return
        deadline = time.monotonic() + timeout_s
        while len(self.catalog.adapters) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in [*self._tasks, *self._watches]:
            task.cancel()
        for task in list(self._background):
            task.cancel()
        await self._flush()  # the counts so far, so a restart starts from them
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:
                pass
        await self.catalog.stop()
        if self.redis is not None:
            await self.redis.aclose()
        if self.nc is not None:
            await self.nc.drain()

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- inbound: load, accepted events, heartbeats ---------------------------------------

    async def _on_load(self, msg: Msg) -> None:
        try:
            self.feed.observe(_load_decoder.decode(msg.data))
        except msgspec.DecodeError as error:
            log.warning("bad_load_message", error=str(error))

    async def _on_requeue(self, msg: Msg) -> None:
        """A worker hands a line back (preempted, draining, a retryable failure) with its next
        attempt: queued here, under this service's identity, when it is one of this service's
        running lines with its own tenant, key and model (`requeue.refusal`)."""
        assert self.replies is not None
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.DecodeError:
            security_events.record(FOREIGN_REQUEUE, why="undecodable", subject=msg.subject)
            return
        parsed = parse_request_id(request.request_id)
        run = self.tracker.runs.get(parsed[0]) if parsed is not None else None
        why = requeue.refusal(request, run, self.reply_subject)
        if why is None:
            subject = subjects.request_subject("batch", request.model, subjects.ANY_TARGET, self.reply_subject)
            request = msgspec.structs.replace(request, priority=bands.ENGINE_PRIORITY["batch"])
            trace = {k: v for k, v in (msg.headers or {}).items() if not k.lower().startswith("nats-")}
            try:
                await dispatch_records.publish(self.replies, request)
                await self.replies.publish_durable(subject, m.encode(request),
                                                   f"{request.request_id}.{request.attempt}", headers=trace)
            except Exception as error:  # the worker tries again; else the line's lease sends it out
                log.warning("batch_requeue_failed", request_id=request.request_id, error=repr(error))
                return
        elif why in requeue.FORGED:
            security_events.record(FOREIGN_REQUEUE, why=why, request_id=request.request_id, tenant=request.tenant,
                                   reply_to=request.reply_to)
        else:
            log.info("batch_requeue_dropped", request_id=request.request_id, why=why)
        if security_events.answerable(msg):
            await msg.respond(m.encode(m.RequeueReply(queued=why is None, why=why or "")))

    async def _on_events(self, msg: Msg) -> None:
        try:
            batch = m.decode_stream_frame(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_stream_batch", subject=msg.subject)
            return
        now = time.monotonic()
        sender = subjects.event_sender(msg.subject)  # the publisher, as NATS permissions bind it
        for event in batch.events:
            if isinstance(event, m.Accepted):
                why = self.tracker.on_accepted(event, now, sender, self._alive)
                if why is not None:
                    security_events.record(line_results.FOREIGN_BATCH_RESULT, why=why, seen_in="accepted",
                                           request_id=event.request_id, attempt=event.attempt, publisher=sender,
                                           worker_named=event.worker_id)
                    continue
                for run, waiting_sender, waiting in self.tracker.released(event):
                    await self.results.judge(run, waiting_sender, waiting)

    def _alive(self, worker: str) -> bool:
        """Whether the worker with subject token `worker` heartbeats."""
        return any(subjects.token(worker_id) == worker for worker_id in self.live_workers.values())

    def _on_heartbeat(self, entry: KeyValue.Entry) -> None:
        beat = decode_or_none(_heartbeat_decoder, entry.value or b"", store="workers", key=entry.key)
        if beat is None:
            return
        self.live_workers[entry.key] = beat.worker_id
        if self._gone.pop(beat.worker_id, None) is not None:
            log.info("worker_back", worker_id=beat.worker_id)

    def _on_worker_gone(self, key: str) -> None:
        worker_id = self.live_workers.pop(key, None)
        if worker_id is not None:
            # Not at once: a busy worker's heartbeat can lapse for a moment, and its lines would
            # then run twice. Batch lines have no client waiting; a few seconds cost nothing.
            self._gone[worker_id] = time.monotonic()

    def _republish_lines_of_dead_workers(self, now: float) -> None:
        for worker_id, since in list(self._gone.items()):
            if now - since >= self.settings.worker_gone_grace_s:
                del self._gone[worker_id]
                moved = self.tracker.worker_gone(worker_id)
                log.warning("worker_gone", worker_id=worker_id, lines_to_republish=moved)

    # ---- batch records --------------------------------------------------------------------

    async def _watch_batches(self) -> None:
        assert self.batches is not None
        while True:
            try:
                async for record in self.batches.watch():
                    if record.id in self._ended and record.id not in self.tracker.runs:
                        continue  # a batch already over (or an older write of it, delivered late)
                    if record.status in m.BATCH_TERMINAL:
                        self._ended.add(record.id)
                        if record.id not in self.tracker.runs:
                            self._latest.pop(record.id, None)
                            continue
                    self._latest[record.id] = record
                    self._dispatch(record.id)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("batch_watch_failed", error=repr(error))
                await asyncio.sleep(1.0)

    def _dispatch(self, batch_id: str) -> None:
        """Start whatever the batch's newest record calls for, unless something already runs for it."""
        record = self._latest.get(batch_id)
        if record is None or batch_id in self._busy:
            return
        step = lifecycle.next_step(record, tracked=batch_id in self.tracker.runs, ended=batch_id in self._ended)
        if step is None:
            return
        work: Callable[[], Awaitable[None]] = {
            "validate": lambda: self._validate(record),
            "resume": lambda: self._resume(record),
            "finish": lambda: self.finisher.finish(record, step.outcome or "completed"),
            "untrack": lambda: self.untrack(batch_id),
        }[step.kind]
        self._spawn_step(record, work)

    def newest_record(self, run: ActiveBatch) -> m.BatchRecord:
        """The newest record seen of a tracked batch (its own, until a newer one came)."""
        return self._latest.get(run.id, run.record)

    async def update_record(self, record: m.BatchRecord,
                            change: Callable[[m.BatchRecord], m.BatchRecord | None]) -> m.BatchRecord | None:
        assert self.batches is not None
        updated = await self.batches.update(record.tenant, record.id, change)
        if updated is not None:
            self._latest[record.id] = updated
            if updated.status in m.BATCH_TERMINAL:
                self._ended.add(record.id)
        return updated

    async def _fail(self, record: m.BatchRecord, errors: list[m.BatchErrorEntry]) -> None:
        now = int(time.time())
        updated = await self.update_record(record, lambda current: lifecycle.failed(current, errors, now))
        FINISHED.labels("failed").inc()
        log.info("batch_failed", errors=len(errors), first=errors[0].message if errors else None,
                 status=updated.status if updated else None)

    # ---- validating → in_progress ---------------------------------------------------------

    async def _validate(self, record: m.BatchRecord) -> None:
        assert self.files is not None and self.tenants is not None
        source = await self.files.get(record.tenant, record.input_file_id)
        if source is None:
            await self._fail(record, [m.BatchErrorEntry(code="file_not_found", param="input_file_id",
                                                        message=f"Input file {record.input_file_id} does not exist.")])
            return
        if source.bytes > self.settings.max_bytes:
            await self._fail(record, [m.BatchErrorEntry(code="file_too_large", param="input_file_id",
                                                        message="The input file is larger than "
                                                                f"{self.settings.max_bytes} bytes.")])
            return
        tenant = await self.tenants.get(record.tenant)
        loop = asyncio.get_running_loop()

        def check_model(model: str) -> str | None:
            # Runs in the validation thread; the lookup (which may read the adapter registry)
            # runs on the service's loop.
            if tenant is None or tenant.disabled:
                return f"Tenant `{record.tenant}` may not run batches."
            try:
                asyncio.run_coroutine_threadsafe(self.catalog.lookup(model, tenant), loop).result()
            except OpenAIError as error:
                return error.message
            return None

        verdict = await asyncio.to_thread(self.validate_file, source, record.endpoint, check_model)
        if isinstance(verdict, list):
            await self._fail(record, verdict)
            return
        now = int(time.time())
        expires_at = self.settings.expires_at(record.created_at, record.expires_at)
        updated = await self.update_record(record, lambda current: lifecycle.in_progress(
            current, model=verdict.model, total=verdict.total, now=now, expires_at=expires_at))
        if updated is None or updated.status != "in_progress":
            return
        log.info("batch_in_progress", total=verdict.total, model=verdict.model, expires_at=updated.expires_at)
        await self.track(updated, verdict, resumed=False)

    def validate_file(self, source: m.FileRecord, endpoint: str,
                      check_model: Callable[[str], str | None]) -> Validated | list[m.BatchErrorEntry]:
        assert self.files is not None
        try:
            with self.files.open(source) as data:
                return validate(data, endpoint, self.limits, check_model)
        except FileNotFoundError:
            return [m.BatchErrorEntry(code="file_not_found", param="input_file_id",
                                      message=f"The bytes of input file {source.id} are missing.")]

    async def _resume(self, record: m.BatchRecord) -> None:
        """An in-progress batch this process did not start: index its file again and go on."""
        assert self.files is not None
        source = await self.files.get(record.tenant, record.input_file_id)
        verdict: Validated | list[m.BatchErrorEntry]
        if source is None:
            verdict = [m.BatchErrorEntry(code="file_not_found", message=f"Input file {record.input_file_id} is gone.")]
        else:
            verdict = await asyncio.to_thread(self.validate_file, source, record.endpoint, lambda model: None)
        if isinstance(verdict, list):
            await self._fail(record, verdict)
            return
        log.info("batch_resumed", total=verdict.total, model=verdict.model)
        await self.track(record, verdict, resumed=True)

    async def track(self, record: m.BatchRecord, verdict: Validated, resumed: bool) -> ActiveBatch | None:
        try:
            base, adapter = await self.catalog.lookup(verdict.model)
        except OpenAIError as error:
            await self._fail(record, [m.BatchErrorEntry(code="model_not_found", message=error.message)])
            return None
        assert self.files is not None
        source = await self.files.get(record.tenant, record.input_file_id)
        if source is None:
            await self._fail(record, [m.BatchErrorEntry(code="file_not_found",
                                                        message=f"Input file {record.input_file_id} is gone.")])
            return None
        run = ActiveBatch(record=record, custom_ids=verdict.custom_ids, offsets=verdict.offsets, base_model=base,
                       adapter=adapter, input_path=str(self.files.path(source)))
        self.tracker.add(run, resumed=resumed)
        await self.results.follow(run)
        return run

    async def untrack(self, batch_id: str) -> None:
        self.tracker.remove(batch_id)
        self._latest.pop(batch_id, None)  # over: only its id is remembered (in `_ended`)
        await self.results.unfollow(batch_id)

    # ---- feeding --------------------------------------------------------------------------

    async def _feed_loop(self) -> None:
        last_lease_check = 0.0
        while True:
            await asyncio.sleep(self.settings.feed_interval_s)
            try:
                now = time.monotonic()
                if now - last_lease_check >= 1.0:
                    last_lease_check = now
                    moved = self.tracker.expire_leases(now)
                    if moved:
                        log.warning("line_leases_expired", lines=moved)
                self._republish_lines_of_dead_workers(now)
                self._check_runs()
                await self._feed_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("feed_failed")
                await asyncio.sleep(1.0)

    def _check_runs(self) -> None:
        """Finish batches whose lines all have a result, and expire those past their window. A
        finish that failed (files, KV) is tried again here until it succeeds."""
        now = time.time()
        for run in self.tracker.batches():
            if run.id in self._busy:
                continue
            record = self.newest_record(run)
            run.finishing = lifecycle.run_outcome(finishing=run.finishing, feeding=run.feeding, loaded=run.loaded,
                                                  all_done=run.finished(), now=now, expires_at=record.expires_at)
            outcome = run.finishing
            if outcome is not None and lifecycle.finishes_now(record, outcome):
                run.feeding = False
                self._spawn_step(record, functools.partial(self.finisher.finish, record, outcome))

    def _spawn_step(self, record: m.BatchRecord, work: Callable[[], Awaitable[None]]) -> None:
        """Run one step of a batch (validate, resume, finish), one at a time per batch; then look
        at its newest record again. A failed step is retried from there a second later."""
        batch_id = record.id
        self._busy.add(batch_id)

        async def guarded() -> None:
            structlog.contextvars.bind_contextvars(batch_id=batch_id, tenant=record.tenant)
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch_step_failed", status=record.status)
                await asyncio.sleep(1.0)
            finally:
                self._busy.discard(batch_id)
            self._dispatch(batch_id)

        self._spawn(guarded(), f"batch-{batch_id}")

    async def _feed_once(self) -> None:
        outstanding = self.tracker.outstanding()
        waiting = self.tracker.waiting()
        LINES_OUT.set(outstanding)
        LINES_WAITING.set(waiting)
        state = self.feed.state()
        for name, value in (("target", state.target), ("spare", state.spare), ("pressure", float(state.pressure)),
                            ("workers", state.workers)):
            FEED.labels(name).set(value)
        if state.pressure != self._paused and (waiting or outstanding):
            self._paused = state.pressure
            log.info("feed_paused" if state.pressure else "feed_resumed", reason=state.reason,
                     target=round(state.target, 1), spare=state.spare, outstanding=outstanding,
                     ttft_p90_s=state.ttft_p90_s, tpot_p90_s=state.tpot_p90_s)
        if not waiting:
            return
        room = min(self.feed.allowance(outstanding), self.settings.max_in_flight - outstanding)
        if room <= 0:
            return
        picks = self.tracker.take(room, time.monotonic())
        if not picks:
            return
        bodies = await asyncio.to_thread(read_bodies, [(run, line) for run, line, _, _ in picks])
        for i, ((run, line, attempt, doubt), body) in enumerate(zip(picks, bodies)):
            try:
                await self.line_publisher.publish(run, line, attempt, doubt, body)
            except Exception as error:  # NATS away, a timeout: these lines go back, tried next tick
                log.warning("line_publish_failed", batch_id=run.id, line=line, error=repr(error))
                for later_run, later_line, later_attempt, _ in reversed(picks[i:]):
                    self.tracker.unpublished(later_run, later_line, later_attempt)
                return

    # ---- progress -------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.flush_interval_s)
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("flush_failed", error=repr(error))

    async def _flush(self) -> None:
        """Write request_counts and usage of batches whose counts moved (compare-and-set)."""
        statuses: dict[str, int] = {}
        for run in self.tracker.batches():
            record = self.newest_record(run)
            statuses[record.status] = statuses.get(record.status, 0) + 1
            if not run.dirty:
                continue
            run.dirty = False
            # The counts as of now, bound (not read again when the compare-and-set retries).
            change = functools.partial(lifecycle.progress, completed=run.completed, failed_lines=run.failed,
                                       usage=run.usage)
            try:
                await self.update_record(record, change)
            except Exception:
                run.dirty = True
                raise
        for status in ("in_progress", "finalizing", "cancelling"):
            BATCHES.labels(status).set(statuses.get(status, 0))


async def serve(settings: BatchSettings) -> None:
    logs.configure("batch", settings.log_level)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    service = BatchService(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    await stop.wait()
    await service.stop()
    log.info("batch_stopped")
