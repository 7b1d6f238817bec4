"""The serving loop: pull requests into free slots, run each on the engine, stream it back.

Ownership of a request: the worker acks the JetStream message when it hands the request to the
engine and tells the gateway (`Accepted`). From then on the gateway, which holds the client,
watches this worker's heartbeat and migrates the request if the worker dies. A worker that dies
between pull and accept leaves the message unacked; JetStream redelivers it after `ack_wait`.

Batch lines take the same path up to the engine and end differently (`batch_lines`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import structlog
from nats.aio.msg import Msg

from inferbus.bus import security_events
from inferbus.runtime import logs, tracing
from inferbus.stores import dispatch_records
from proto import messages as m
from proto import subjects
from proto.bands import Band

from .adapters import Adapters
from .attempt import Attempt, bill_delivered, forget, give_up_earlier
from .engine import EngineClient, EngineError, EngineUpdate
from .metrics import ABANDONED, DUPLICATES, ENGINE_ERRORS, FREE_SLOTS, PINNED_ELSEWHERE, QUEUE_WAIT, REQUESTS, RUNNING
from .preemption import PreemptionPolicy
from .pull_plan import ConsumerState, plan_pulls
from .puller import Puller
from .release_check import pin_refusal
from .reporting import ServingStats, tpot_of
from .slots import SlotBudget

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

    from .cancels import CancelMemory
    from .claims import Claims
    from .engine import EngineLoad
    from .engine_health import EngineHealth
    from .events_out import EventSender
    from .fault_hold import FaultHold
    from .gpu_death import GpuDeathDetector
    from .liveness import PauseDetector
    from .release_check import AdapterOutcomes, ReleaseCounters
    from .settings import WorkerSettings
    from .tasks import Background
    from .usage import UsageReporter

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.worker")

SCARCE_POLL_S = 0.05  # a consumer's turn when slots are scarce: a waiting request waits ≲ 4 turns
LOOK_INTERVAL_S = 0.2  # how often a consumer without a pull in flight asks the server what waits on it
BATCH_POLL_S = 0.25  # a batch pull holds its slots at most this long, so interactive gets them back soon
# Failures that say nothing of this worker's GPU, so never count toward giving it up (gpu_death): a
# pause of the worker itself, an engine known down (its own verdict), an adapter the engine cannot
# load or that fails its check, and a decode worker's prefill half that no prefill worker could take
# or that failed on one (the prefill pool's trouble: the decode engine only waited).
NOT_THE_GPU = frozenset({"worker_paused", "engine_unavailable", "adapter_unavailable", "no_prefill_worker",
                         "prefill_failed"})
_request_decoder = msgspec.msgpack.Decoder(m.InferenceRequest)


def consumer_specs(bands: Sequence[Band], worker_id: str) -> list[tuple[Band, str | None]]:
    """(band, owner) of each consumer a worker pulls, most important first. Batch lines are only
    ever queued on the shared subject, so the batch band has no per-worker consumer."""
    return [(band, owner) for band in bands for owner in ((None,) if band == "batch" else (worker_id, None))]


class DecodeStream(Protocol):
    """A decode worker's side (decode_side.py): the stream of a request whose prompt a prefill
    worker computes."""

    def stream(self, request: m.InferenceRequest, entry: Attempt,
               headers: dict[str, str]) -> AsyncIterator[EngineUpdate]: ...


class BatchSide(Protocol):
    """A worker's batch lines (batch_lines.py), as serving, the worker and its load report use them."""

    pullers: list[Puller]
    interactive_consumers: list[str]

    def room(self) -> int: ...
    def waiting(self) -> int: ...
    async def serve(self, msg: Msg, entry: Attempt) -> None: ...
    async def checkpoint(self, entry: Attempt) -> None: ...
    async def check(self, load: EngineLoad) -> None: ...
    async def preempt(self, entry: Attempt, reason: str) -> None: ...


class Served(Protocol):
    """What serving may touch of its worker: what a request's life reads and writes, and what it
    tells the worker (the engine looks down, a consumer is gone, the loop ticked)."""

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def nc(self) -> Client: ...
    @property
    def js(self) -> JetStreamContext: ...
    @property
    def health(self) -> EngineHealth: ...
    @property
    def pause(self) -> PauseDetector: ...
    @property
    def gpu(self) -> GpuDeathDetector: ...
    @property
    def adapters(self) -> Adapters: ...
    @property
    def decode(self) -> DecodeStream | None: ...
    @property
    def claims(self) -> Claims: ...
    @property
    def cancels(self) -> CancelMemory: ...
    @property
    def events(self) -> EventSender: ...
    @property
    def usage(self) -> UsageReporter: ...
    @property
    def fault_hold(self) -> FaultHold: ...
    @property
    def background(self) -> Background: ...
    @property
    def stats(self) -> ServingStats: ...
    @property
    def release_counts(self) -> ReleaseCounters: ...
    @property
    def adapter_outcomes(self) -> AdapterOutcomes: ...
    @property
    def running(self) -> dict[str, Attempt]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def wake(self) -> asyncio.Event: ...
    @property
    def load_changed(self) -> asyncio.Event: ...

    def bands(self) -> list[Band]: ...
    def pulls_held(self) -> bool: ...
    def engine_down(self, why: str) -> None: ...
    def verify_soon(self, why: str) -> None: ...
    def note_tick(self) -> None: ...


class Serving:
    """A worker's slots and what fills them; built once its engine is loaded (its capacity known).
    `make_batch` builds its batch lines (batch_lines.BatchLines, which takes the whole worker)."""

    def __init__(self, worker: Served, capacity: int, preemption: PreemptionPolicy,
                 make_batch: Callable[[Serving], BatchSide]) -> None:
        s = worker.settings
        self.worker = worker
        self.preemption = preemption
        specs = consumer_specs(worker.bands(), s.worker_id)
        self.budget = SlotBudget(capacity, pullers=max(1, len(specs)))
        self.batch = make_batch(self)
        self.pullers: list[Puller] = []
        # Most important first: earlier pullers get slots first. Batch pullers take only what the
        # preemption policy grants, and hold it briefly when the batch queue is empty.
        for band, owner in specs:
            batch = band == "batch"
            puller = Puller(worker.nc, subjects.REQUESTS_STREAM, subjects.request_consumer(band, s.model, owner),  # type: ignore[arg-type]
                            self.budget, self.on_request, wake=worker.wake,
                            expires_s=min(s.fetch_timeout_s, BATCH_POLL_S) if batch else s.fetch_timeout_s,
                            room=self.batch.room if batch else None, on_consumer_gone=worker.verify_soon)
            self.pullers.append(puller)
            if batch:
                self.batch.pullers.append(puller)
            else:
                self.batch.interactive_consumers.append(puller.consumer)
        self._own_target = subjects.token(s.worker_id)

    @property
    def capacity(self) -> int:
        return self.budget.capacity

    # ---- pulling ---------------------------------------------------------------------------

    async def pull_loop(self) -> None:
        worker, pullers, budget = self.worker, self.pullers, self.budget
        fetch_timeout_s = worker.settings.fetch_timeout_s
        turn = 0
        while not worker.draining:
            worker.wake.clear()
            if worker.pulls_held():
                await asyncio.sleep(SCARCE_POLL_S)
                continue
            if not worker.health.up:
                # Its engine is down: a request taken now would fail at once and bounce between
                # workers. The engine watch wakes this loop when it is back.
                await _wait(worker.wake, fetch_timeout_s)
                continue
            # Known waiting work first, most important first; a long-poll of one slot per idle
            # consumer only when slots remain for all of them; short turns otherwise (pull_plan.py).
            plan = plan_pulls(budget.free, [ConsumerState(p.outstanding, p.waiting, p.room()) for p in pullers], turn)
            turn = plan.turn
            for order in plan.orders:
                await pullers[order.consumer].pull(order.slots, None if order.long else SCARCE_POLL_S)
            FREE_SLOTS.set(budget.free)
            await _wait(worker.wake, fetch_timeout_s)

    async def look_loop(self) -> None:
        """Ask the server how many requests wait on each consumer that has no pull in flight: a
        consumer without one learns of new work from nobody else while slots are scarce, and
        the plan gives slots to the most important queue with work, not to whichever pulled last."""
        worker = self.worker
        while not worker.draining:
            await asyncio.sleep(LOOK_INTERVAL_S)
            if worker.pulls_held() or not worker.health.up:
                continue
            woke = False
            for puller in self.pullers:
                if puller.outstanding:
                    continue
                try:
                    info = await worker.js.consumer_info(subjects.REQUESTS_STREAM, puller.consumer,
                                                         timeout=LOOK_INTERVAL_S)
                except Exception:  # the next look asks again; pulls go on meanwhile
                    continue
                if puller.outstanding:
                    continue  # a pull went out meanwhile: its messages say more than this count
                pending = info.num_pending or 0
                if pending and not puller.waiting:
                    woke = True
                puller.waiting = pending
            if woke:
                worker.wake.set()

    def on_request(self, msg: Msg) -> None:
        worker = self.worker
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.DecodeError as error:
            log.error("bad_request_message", error=str(error))
            worker.background.spawn(msg.term())
            self.release_slot()
            return
        if not subjects.request_reply_allowed(msg.subject, request.reply_to):
            # Its publisher may name only itself in the subject: a reply_to naming anyone else is
            # an attempt to have another gateway's stream sent elsewhere (or to forge one).
            log.error("request_not_owner", request_id=request.request_id, subject=msg.subject)
            worker.background.spawn(msg.term())
            self.release_slot()
            return
        if subjects.worker_of_request_subject(msg.subject) == self._own_target:
            worker.stats.pulled_own += 1
        if request.batch_id is not None and request.request_id in worker.running:
            # Another attempt of a line this worker already runs (the batch service republished
            # it after a restart or a lapsed heartbeat): the running one will report the line.
            log.info("batch_duplicate_dropped", request_id=request.request_id, attempt=request.attempt)
            worker.background.spawn(msg.ack())
            self.release_slot()
            return
        if request.batch_id is not None:
            self._start(msg, request, self.batch.serve)
            return
        held = worker.running.get(request.request_id)
        if held is not None and held.request.attempt == request.attempt:
            self._absorb(msg, request, "here")  # delivered again while it runs here
            return
        # Claimed first (claims.py): of two deliveries of one attempt, on any workers, one runs.
        worker.background.spawn(self._claim_then_serve(msg, request))

    async def _claim_then_serve(self, msg: Msg, request: m.InferenceRequest) -> None:
        worker = self.worker
        # Run only what a gateway dispatched, for the tenant and owner it dispatched it for: an
        # identity that may move requests on the queue (the router) creates no work of its own.
        try:
            dispatched = await dispatch_records.lookup(worker.js, request.request_id)
        except Exception as error:  # NATS away: not taken now, delivered again after the ack wait
            log.warning("dispatch_lookup_failed", request_id=request.request_id, error=repr(error))
            worker.background.spawn(msg.nak(delay=1.0))
            self.release_slot()
            return
        why = dispatch_records.request_refusal(request, dispatched)
        if why is not None:
            security_events.record(dispatch_records.UNDISPATCHED_REQUEST, why=why, request_id=request.request_id,
                                   tenant=request.tenant, reply_to=request.reply_to, subject=msg.subject,
                                   dispatched_tenant=dispatched.tenant if dispatched else None)
            worker.background.spawn(msg.term())
            self.release_slot()
            return
        if not await worker.claims.claim(request):
            self._absorb(msg, request, "here" if request.request_id in worker.running else "elsewhere")
            return
        held = worker.running.get(request.request_id)
        if held is not None and held.request.attempt == request.attempt:
            self._absorb(msg, request, "here")  # the other delivery started while this one claimed
            return
        self._start(msg, request, self.serve)

    def _start(self, msg: Msg, request: m.InferenceRequest,
               serve: Callable[[Msg, Attempt], Coroutine[Any, Any, None]]) -> None:
        worker = self.worker
        earlier = give_up_earlier(worker.running, request)
        if earlier is not None:
            log.warning("earlier_attempt_given_up", request_id=request.request_id, attempt=earlier.request.attempt,
                        next_attempt=request.attempt)
            worker.background.spawn(worker.engine.abort(earlier.request.engine_rid()))
        entry = Attempt(request=request, pause_epoch=worker.pause.epoch)
        worker.running[request.request_id] = entry
        if request.band == "batch":
            worker.stats.batch_in_flight += 1
        RUNNING.set(len(worker.running))
        entry.task = asyncio.ensure_future(serve(msg, entry))

    def _absorb(self, msg: Msg, request: m.InferenceRequest, holder: str) -> None:
        """A delivery of an attempt that runs (or ran) already: ack it so it is not delivered
        again, and send nothing: the client sees the one run, and is billed for it once."""
        DUPLICATES.labels(holder).inc()
        log.warning("duplicate_delivery_absorbed", request_id=request.request_id, attempt=request.attempt,
                    holder=holder)
        self.worker.background.spawn(msg.ack())
        self.release_slot()

    def release_slot(self) -> None:
        self.budget.release(1)
        self.worker.wake.set()

    # ---- one interactive request -----------------------------------------------------------

    async def serve(self, msg: Msg, entry: Attempt) -> None:
        worker = self.worker
        request = entry.request
        structlog.contextvars.bind_contextvars(request_id=request.request_id, tenant=request.tenant)
        with tracing.span(tracer, "worker.generate", msg.headers) as trace_headers:
            status, usage, finish = "failed", m.Usage(prompt_tokens=0, completion_tokens=request.resumed_tokens), None
            publish_usage = True
            abandoned: str | None = None  # why this attempt's work is the platform's, not the tenant's
            try:
                await msg.ack()
                await worker.fault_hold.at("after_ack", request.request_id)
                if worker.cancels.superseded(request.request_id, request.attempt):
                    publish_usage = False  # the gateway moved on before this attempt started: no work done
                    return
                cancelled = worker.cancels.reason(subjects.reply_owner(request.reply_to), request.request_id)
                if cancelled is not None:
                    status, finish = "cancelled", "abort"
                    # After a deadline the gateway bills what the client got; otherwise nothing ran.
                    publish_usage = cancelled != "deadline"
                    return
                if time.time() > request.deadline:
                    finish = "error"
                    worker.events.send(request, m.StreamError(
                        request_id=request.request_id, attempt=request.attempt, code="timeout",
                        message="request deadline passed before a worker could start it", status=504,
                    ))
                    publish_usage = False  # nothing ran; the gateway bills what the client got
                    return
                refusal = pin_refusal(request, worker.release_counts.release_id)
                if refusal is not None:
                    # Before any work: its gateway places the next attempt on a worker of its release.
                    PINNED_ELSEWHERE.inc()
                    log.warning("pinned_elsewhere", why=refusal)
                    finish, publish_usage = "error", False
                    worker.events.send(request, m.StreamError(
                        request_id=request.request_id, attempt=request.attempt, code="release_mismatch",
                        message=refusal, retryable=True, status=503,
                    ))
                    return
                queue_wait = max(0.0, time.time() - request.created)
                QUEUE_WAIT.observe(queue_wait)
                if request.band != "batch" and request.attempt == 0:
                    worker.stats.observe_queue_wait(queue_wait)
                worker.events.send(request, m.Accepted(
                    request_id=request.request_id, attempt=request.attempt,
                    worker_id=worker.settings.worker_id, queue_wait=queue_wait,
                ))
                status, usage, finish = await self.generate(request, entry, trace_headers)
                if entry.handed_off:
                    abandoned = "handoff"  # the next attempt reports the client-visible totals
                    worker.events.send(request, m.Handoff(
                        request_id=request.request_id, attempt=request.attempt, worker_id=worker.settings.worker_id
                    ))
            except EngineError as error:
                ENGINE_ERRORS.inc()
                if error.status >= 500 and error.code not in NOT_THE_GPU:
                    worker.gpu.engine_error()
                log.warning("engine_error", code=error.code, error=str(error), retryable=error.retryable)
                # The gateway bills what the client received when a request ends in an error, and a
                # retryable one continues elsewhere: this attempt's work is the platform's.
                abandoned = error.code if error.code == "worker_paused" else "engine_error"
                worker.events.send(request, m.StreamError(
                    request_id=request.request_id, attempt=request.attempt, code=error.code,
                    message=str(error), retryable=error.retryable, status=error.status,
                ))
            except Exception as error:  # never leave a client hanging on a bug
                log.exception("worker_request_failed")
                worker.events.send(request, m.StreamError(
                    request_id=request.request_id, attempt=request.attempt, code="internal_error",
                    message=f"worker failed: {type(error).__name__}", retryable=True, status=500,
                ))
                abandoned = "internal_error"
            finally:
                forget(worker.running, entry)
                if request.batch_id is None:
                    worker.events.replay.ended(request.request_id, request.attempt)
                RUNNING.set(len(worker.running))
                self.release_slot()
                worker.stats.completed += 1
                if request.band == "batch":
                    worker.stats.batch_in_flight -= 1
                    worker.stats.completed_batch += 1
                elif not request.pinned:
                    generated, finished_at = usage.completion_tokens - request.resumed_tokens, time.time()
                    worker.stats.observe_tpot(entry, generated, finished_at)
                    worker.release_counts.count(status)
                    if request.adapter_canary and request.adapter:
                        worker.adapter_outcomes.finished(request.adapter, status,
                                                         tpot_of(entry, generated, finished_at))
                REQUESTS.labels(status).inc()
                structlog.contextvars.unbind_contextvars("request_id", "tenant")
                if entry.given_up:
                    # The gateway gave this attempt up (and bills the tenant what the client got).
                    abandoned = abandoned or ("deadline" if entry.cancel_reason == "deadline" else "superseded")
                if abandoned is not None:
                    ABANDONED.labels(abandoned).inc()
                if entry.usage_written:
                    pass  # before its Final left (`generate`); a give-up since then bills nothing more
                elif abandoned is not None:
                    if entry.prefilled or entry.completion > request.resumed_tokens:
                        worker.background.spawn(worker.usage.publish(request, status, entry.work(), finish,
                                                                     billed_to="platform"))
                elif publish_usage:
                    if status == "cancelled":
                        usage, unseen = bill_delivered(usage, entry.delivered_tokens)
                        if unseen:
                            worker.background.spawn(worker.usage.publish(
                                request, status, m.Usage(prompt_tokens=0, completion_tokens=unseen), finish,
                                billed_to="platform"))
                    # Spawned, not awaited: this also runs after the early returns above.
                    worker.background.spawn(worker.usage.publish(request, status, usage, finish))

    async def generate(
        self, request: m.InferenceRequest, entry: Attempt, trace_headers: dict[str, str]
    ) -> tuple[str, m.Usage, str | None]:
        """Run `request` on the engine: interactive tokens stream to the gateway as they come;
        a batch line's are kept on `entry` for its one result."""
        worker = self.worker
        seq = 0
        completion = request.resumed_tokens
        prompt_tokens = request.prompt_tokens
        cached = 0
        batch = request.batch_id is not None
        update: EngineUpdate
        if request.adapter:
            await worker.adapters.ensure(request.adapter)
        # A decode worker's engine gets the prompt's KV from a prefill worker's (decode_side.py).
        stream = (worker.decode.stream(request, entry, trace_headers) if worker.decode is not None
                  else engine_stream(worker.engine, worker.adapters, request, trace_headers, worker.engine_down))
        async for update in stream:
            worker.gpu.progress()
            if not entry.prefilled:
                entry.prefilled = True
                entry.first_token_at = time.time()
                # A migration's TTFT is not the client's; a pinned request (an eval run) is not the
                # canary's traffic, whose latencies these histograms also carry to its SLO gate.
                if request.band != "batch" and request.attempt == 0 and not request.pinned:
                    worker.stats.observe_ttft(entry.first_token_at - request.created)
                    if request.adapter_canary and request.adapter:
                        worker.adapter_outcomes.first_token(request.adapter, entry.first_token_at - request.created)
                worker.load_changed.set()  # its prefill is done: tell the router now, not at the next tick
            completion = request.resumed_tokens + update.completion_tokens
            if prompt_tokens is None and update.prompt_tokens is not None:
                prompt_tokens = max(0, update.prompt_tokens - request.resumed_tokens)
            cached = min(update.cached_tokens, prompt_tokens or 0)
            entry.completion, entry.prompt_tokens, entry.cached = completion, prompt_tokens, cached
            if not batch:
                worker.note_tick()
                if entry.pause_epoch != worker.pause.epoch:
                    # This worker was stopped mid-stream, long enough to be declared dead: the
                    # gateway may already continue it elsewhere. Give it up, whichever it did;
                    # the client sees one stream either way.
                    await worker.engine.abort(request.engine_rid())
                    raise EngineError("the worker was paused; continuing on another worker", code="worker_paused",
                                      retryable=True, status=503)
            if batch:  # no stream to a client: the line's text is kept for its one result
                entry.text_parts.append(update.text)
                entry.token_ids.extend(update.token_ids)
                if update.finish is None:
                    await self.batch.checkpoint(entry)
                    continue
            if update.finish is None:
                merged = worker.events.send(request, m.TokenChunk(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=update.text,
                    completion_tokens=completion, prompt_tokens=prompt_tokens if seq == 0 else None,
                    token_ids=update.token_ids, logprobs=update.logprobs,
                    worker_id=worker.settings.worker_id if seq == 0 else "",
                ))
                if not merged:  # a merged chunk went into the waiting one, which keeps its number
                    seq += 1
                continue
            finish_type = update.finish.get("type")
            reason: m.FinishReason = {"stop": "stop", "length": "length", "abort": "abort"}.get(finish_type, "stop")  # type: ignore[arg-type,assignment]
            matched = update.finish.get("matched")
            usage = m.Usage(prompt_tokens=prompt_tokens or 0, completion_tokens=completion, cached_tokens=cached)
            entry.matched = matched if isinstance(matched, str) else None
            status = "cancelled" if reason == "abort" else "completed"
            if not entry.handed_off and not batch:
                if status == "completed" and not entry.given_up:
                    # The tenant's usage is on disk before the answer ends: a worker that dies
                    # after its Final left can no longer have served a request nobody is billed for
                    # (one that dies before has its request continued elsewhere, under the same
                    # ledger id, so it is billed once either way). A cancelled request's client is
                    # gone: its usage is written as the attempt ends (`serve`).
                    await worker.usage.publish(request, status, usage, reason)
                    entry.usage_written = True
                    await worker.fault_hold.at("before_final", request.request_id)
                worker.events.send(request, m.Final(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=update.text,
                    finish_reason=reason, usage=usage, matched_stop=matched if isinstance(matched, str) else None,
                    worker_id=worker.settings.worker_id, token_ids=update.token_ids, logprobs=update.logprobs,
                ))
            return status, usage, reason
        raise EngineError("engine stream ended early", retryable=True, status=502)


async def engine_stream(engine: EngineClient, adapters: Adapters, request: m.InferenceRequest,
                        headers: dict[str, str], engine_down: Callable[[str], None]) -> AsyncIterator[EngineUpdate]:
    """The engine's stream for `request`. An adapter the engine says it never loaded (it restarted
    since) is loaded again and the request sent once more: the refusal comes before any token.
    `engine_down` is told when the engine does not answer."""
    for attempt in (0, 1):
        try:
            async for update in engine.generate(request, headers):
                yield update
            return
        except EngineError as error:
            if error.code == "engine_unavailable":
                engine_down(str(error))
            if attempt or error.code != "adapter_not_loaded" or not request.adapter:
                raise
            log.warning("adapter_lost_by_engine", adapter=request.adapter, error=str(error))
            adapters.forget(request.adapter)
            await adapters.ensure(request.adapter)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout=timeout)
    except asyncio.TimeoutError:
        pass
