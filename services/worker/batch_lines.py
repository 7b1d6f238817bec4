"""A worker's batch lines: how many it pulls, which give way to interactive work, and how each
attempt ends (one durable result, or back on the batch queue with its progress).

The decisions are pure and shared with the fleet simulator: `PreemptionPolicy` (pull room and the
load tick's preemption check) and `attempt.line_outcome` (how an attempt ends and the next attempt
it makes). This is the shell that carries them out: engine aborts, JetStream publishes.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

import structlog
from nats.aio.msg import Msg

from inferbus.runtime import logs, tracing
from proto import messages as m
from proto import subjects

from .attempt import Attempt, Failure, forget, line_outcome, line_usage
from .engine import EngineError, EngineLoad
from .metrics import BATCH_REQUEUED, ENGINE_ERRORS, PREEMPTIONS, QUEUE_WAIT, REQUESTS, RUNNING
from .preemption import Check, RunningLine, WorkerState
from .puller import Puller

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from inferbus.bus.replies import Replies

    from .cancels import CancelMemory
    from .engine import EngineClient
    from .events_out import EventSender
    from .reporting import ServingStats
    from .serving import Serving
    from .settings import WorkerSettings
    from .tasks import Background
    from .usage import UsageReporter

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.worker")

PUBLISH_TRIES = 5  # publish attempts for a line's result or next attempt (then the batch service's lease re-feeds it)
_requeue_reply = m.decoder(m.RequeueReply)



class Batching(Protocol):
    """What batch lines may touch of their worker: the lines it runs, the engine and the bus they
    run on, and where their results, usage and counts go."""

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def js(self) -> JetStreamContext: ...
    @property
    def replies(self) -> Replies: ...
    @property
    def cancels(self) -> CancelMemory: ...
    @property
    def events(self) -> EventSender: ...
    @property
    def usage(self) -> UsageReporter: ...
    @property
    def background(self) -> Background: ...
    @property
    def stats(self) -> ServingStats: ...
    @property
    def running(self) -> dict[str, Attempt]: ...
    @property
    def draining(self) -> bool: ...

class BatchLines:
    def __init__(self, worker: Batching, serving: Serving) -> None:
        self.worker = worker
        self.serving = serving
        self.pullers: list[Puller] = []
        self.interactive_consumers: list[str] = []  # polled for waiting work while batch runs
        self.last_check = Check()  # the last load tick's: what blocks batch pulls until the next

    # ---- pulling and giving way ------------------------------------------------------------

    def reserved(self) -> int:
        """Slots reserved by batch pulls on their way."""
        return sum(puller.outstanding for puller in self.pullers)

    def waiting(self) -> int:
        """Batch lines this worker took that have no first token yet (queued in, or prefilled by, the engine)."""
        return sum(1 for e in self.worker.running.values() if e.request.band == "batch" and not e.prefilled)

    def room(self) -> int:
        """Slots the batch pullers may reserve now (the Puller asks before every pull)."""
        worker = self.worker
        batch_in_flight = worker.stats.batch_in_flight
        return self.serving.preemption.pull_room(
            self.serving.capacity, len(worker.running) - batch_in_flight, batch_in_flight,
            batch_prefilling=self.waiting(), reserved=self.reserved(), last=self.last_check, draining=worker.draining,
        )

    async def check(self, load: EngineLoad) -> None:
        """Every load tick: preempt batch lines for interactive work waiting on the bus or (without
        engine priority; the policy decides) in the engine. The bus is asked (consumer info) only
        when the policy needs it."""
        worker, policy = self.worker, self.serving.preemption
        interactive = [e for e in worker.running.values() if e.request.band != "batch"]
        state = WorkerState(
            capacity=self.serving.capacity, interactive=len(interactive),
            interactive_stalled=policy.stalled(time.time(), load.waiting,
                                               (e.started for e in interactive if not e.prefilled)),
            batch=[RunningLine(request_id=e.request.request_id, context_tokens=(e.prompt_tokens or 0) + e.completion,
                            generated=e.completion, started=e.started)
                   for e in worker.running.values() if e.preemptible],
            reserved=self.reserved(), draining=worker.draining,
        )
        waiting = await self._interactive_pending() if policy.asks_bus(state) else 0
        self.last_check = check = policy.check(state, waiting)
        for request_id in check.victims:
            entry = worker.running.get(request_id)
            if entry is not None and entry.preemptible:
                await self.preempt(entry, "preempted")

    async def _interactive_pending(self) -> int:
        """Interactive requests queued on this worker's consumers (its own and the shared ones)."""
        js = self.worker.js
        infos = await asyncio.gather(
            *(js.consumer_info(subjects.REQUESTS_STREAM, name, timeout=1.0) for name in self.interactive_consumers),
            return_exceptions=True,
        )
        pending = 0
        for info in infos:
            if isinstance(info, BaseException):
                log.warning("consumer_info_failed", error=repr(info))
                continue
            pending += info.num_pending or 0
        return pending

    async def preempt(self, entry: Attempt, reason: str) -> None:
        """Ask a running line to give way: aborted in the engine, it goes back on the queue."""
        request = entry.request
        entry.requeue = reason
        if reason == "preempted":
            PREEMPTIONS.inc()
        log.info("batch_preempted", request_id=request.request_id, attempt=request.attempt, reason=reason,
                 tokens_carried=entry.completion, context_tokens=(entry.prompt_tokens or 0) + entry.completion)
        await self.worker.engine.abort(request.engine_rid())

    async def checkpoint(self, entry: Attempt) -> None:
        """Between updates of a batch line: stop it once it was asked to give way or is past due."""
        engine = self.worker.engine
        if entry.requeue is None and not entry.cancelled and time.time() > entry.request.deadline:
            entry.cancelled, entry.cancel_reason = True, "deadline"
            await engine.abort(entry.request.engine_rid())
        elif (entry.requeue is not None or entry.cancelled) and not entry.abort_resent:
            # The first abort may have reached the engine before the request did: say it again.
            entry.abort_resent = True
            await engine.abort(entry.request.engine_rid())

    # ---- one attempt -----------------------------------------------------------------------

    async def serve(self, msg: Msg, entry: Attempt) -> None:
        """One attempt at a batch line. It ends with ONE durable `BatchLineResult` (then its usage
        event), or goes back to the batch queue as the next attempt with the progress so far
        (preemption, drain, retryable failure), in which case this attempt reports nothing."""
        worker = self.worker
        request = entry.request
        entry.completion, entry.prompt_tokens = request.resumed_tokens, request.prompt_tokens
        structlog.contextvars.bind_contextvars(request_id=request.request_id, tenant=request.tenant)
        # A failure that ends the line. A retryable one leaves `finish` unset instead, and the
        # line is requeued like any attempt that did not finish.
        failure: Failure | None = None
        finish: str | None = None
        try:
            with tracing.span(tracer, "worker.generate", msg.headers) as trace_headers:
                try:
                    await msg.ack()
                    if worker.cancels.reason(subjects.reply_owner(request.reply_to), request.request_id) is not None:
                        entry.cancelled = True
                    elif time.time() <= request.deadline:
                        queue_wait = max(0.0, time.time() - request.created)
                        QUEUE_WAIT.observe(queue_wait)
                        worker.events.send(request, m.Accepted(
                            request_id=request.request_id, attempt=request.attempt,
                            worker_id=worker.settings.worker_id, queue_wait=queue_wait,
                        ))
                        if entry.requeue is None and not entry.cancelled:  # else preempted before it started
                            _, _, finish = await self.serving.generate(request, entry, trace_headers)
                except EngineError as error:
                    ENGINE_ERRORS.inc()
                    log.warning("engine_error", code=error.code, error=str(error), retryable=error.retryable)
                    if not error.retryable:
                        failure = (error.code, str(error), error.status)
                except Exception:  # a bug must not lose the line: it runs again elsewhere
                    log.exception("worker_request_failed")
            status, result, follow_up = line_outcome(entry, finish, failure, now=time.time(),
                                                     max_attempts=self.serving.preemption.config.max_attempts,
                                                     worker_id=worker.settings.worker_id)
        finally:
            forget(worker.running, entry)
            RUNNING.set(len(worker.running))
            self.serving.release_slot()
            if request.band == "batch":
                worker.stats.batch_in_flight -= 1
            structlog.contextvars.unbind_contextvars("request_id", "tenant")
        REQUESTS.labels(status).inc()
        if follow_up is not None:
            worker.background.spawn(self._requeue(follow_up, entry.requeue or "engine_error"))
            return
        assert result is not None  # line_outcome gives a result or a next attempt
        worker.stats.completed += 1
        if request.band == "batch":
            worker.stats.completed_batch += 1
        finish = result.finish_reason or "error"
        worker.background.spawn(self._finish(request, result, status, line_usage(entry), finish))

    async def _finish(self, request: m.InferenceRequest, result: m.BatchLineResult, status: str,
                      usage: m.Usage, finish: str) -> None:
        """Usage first (on disk, its delivery under way), then the result, durably (the batch service
        keeps the first per line). The other order lost the line's usage when the worker died
        between the two: the result stood, so the line never ran again. This order at worst runs a
        line again after its usage went out, and the ledger keeps one tenant event per request id.

        The result goes out under this worker's name (`inferbus.batchres.<batch>.w.<worker>`) with
        a message id nobody else can compute (a nonce drawn here, kept for the retries): a worker
        that published first under the request id cannot have this one dropped as a duplicate."""
        assert request.batch_id is not None  # only batch lines come here
        await self.worker.usage.publish(request, status, usage, finish)
        worker_id = self.worker.settings.worker_id
        subject = subjects.batch_result_subject(request.batch_id, subjects.RESULT_FROM_WORKER, worker_id)
        msg_id = m.batch_result_publish_id(result, f"{subjects.RESULT_FROM_WORKER}.{subjects.token(worker_id)}",
                                           m.new_usage_nonce())
        if not await self._publish(subject, m.encode(result), msg_id, "batch_result_publish_failed",
                                   request_id=request.request_id):
            # The batch service re-feeds a line without a result after its lease: it runs again.
            log.error("batch_result_lost", request_id=request.request_id)

    async def _requeue(self, request: m.InferenceRequest, reason: str) -> None:
        """Hand a batch line back to its batch service with its progress: the service queues the next
        attempt (a worker may not create work). Without an answer the line's lease sends it out again."""
        subject = subjects.requeue_subject(subjects.reply_owner(request.reply_to))
        answer: m.RequeueReply | None = None
        for attempt in range(PUBLISH_TRIES):
            try:
                reply = await self.worker.replies.request(subject, m.encode(request), 5.0, headers=tracing.inject())
                answer = _requeue_reply.decode(reply.data)
                break
            except Exception as error:
                log.warning("batch_requeue_failed", request_id=request.request_id, error=repr(error), try_=attempt + 1)
                await asyncio.sleep(0.2 * 2**attempt)
        if answer is None or not answer.queued:
            log.error("batch_line_not_requeued", request_id=request.request_id, attempt=request.attempt,
                      why=answer.why if answer is not None else "no answer")
            return
        BATCH_REQUEUED.labels(reason).inc()
        log.info("batch_requeued", request_id=request.request_id, attempt=request.attempt, reason=reason,
                 tokens_carried=request.resumed_tokens)

    async def _publish(self, subject: str, data: bytes, msg_id: str, failed: str, *, request_id: str,
                       headers: dict[str, str] | None = None) -> bool:
        """Publish to JetStream with a few retries (backing off); False if none was acknowledged."""
        for attempt in range(PUBLISH_TRIES):
            try:
                await self.worker.replies.publish_durable(subject, data, msg_id, headers=headers)
                return True
            except Exception as error:
                log.warning(failed, request_id=request_id, error=repr(error), try_=attempt + 1)
                await asyncio.sleep(0.2 * 2**attempt)
        return False
