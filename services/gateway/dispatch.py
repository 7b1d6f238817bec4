"""Gateway side of a request's life on the bus: place, publish, relay events, migrate on failure.

One wildcard subscription per gateway receives every stream event meant for its requests. A
watch on the `workers` KV bucket tells which workers are alive (`worker_watch`); when the worker
holding a request dies (heartbeat expired or deleted, or a new process under its id) or hands it
back, the request continues on another worker from the prompt plus the text already sent, so the
client sees one stream.

The decisions are pure modules beside it: `flight` (a request in flight: its next attempt, whose
events it takes, its waits and silences), `placement_choice` (where it is queued),
`queue_window` and `fairness` (when it is published). The shells it uses: `worker_watch` (which
workers are alive, what becomes of their requests when one is not, with `worker_probe`),
`stream_resend` (events lost on the bus).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.bus import patience, security_events
from inferbus.bus.outbox import Outbox
from inferbus.bus.replies import PublishError, Replies
from inferbus.releases import record
from inferbus.runtime import logs, tracing
from inferbus.stores import dispatch_records
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE
from proto import bands, subjects
from proto import messages as m

from .fairness import FairQueue
from .flight import (
    DispatchError,
    Flight,
    error_usage,
    foreign_publisher,
    foreign_sender,
    measures_load,
    next_attempt,
    shows_loss,
)
from .metrics import (
    FAIR_QUEUE,
    MIGRATIONS,
    PLACEMENT_SECONDS,
    PLACEMENTS,
    PLACEMENTS_OVER_BUDGET,
    PLACEMENTS_PINNED,
)
from .placement_choice import beside_lead, judge_placement, pinned_worker, placement_question
from .queue_window import QueueWindow
from .stream_resend import resend
from .worker_watch import WorkerWatch

log = logs.get(__name__)

_placement_decoder = msgspec.msgpack.Decoder(m.PlacementReply)


def _observe_placement(outcome: str, seconds: float) -> None:
    PLACEMENT_SECONDS.labels(outcome).observe(seconds)


class Dispatcher:
    def __init__(
        self,
        nc: Client,
        workers: KeyValue,
        *,
        gateway_id: str,
        heartbeat_ttl_s: float,
        max_attempts: int,
        placement_timeout_s: float,
        placement_patience_s: float = 0.0,
        window_per_worker: int = 2,
        free_slots: Callable[[], int] = lambda: 0,
        worker_free_slots: Callable[[str], int | None] = lambda worker_id: None,
        placement_fits: Callable[[str, str, int], bool] = lambda worker_id, band, queued_here: True,
        on_started: Callable[[str, float], None] = lambda band, seconds: None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        accept_timeout_s: float = 5.0,
        liveness_timeout_s: float = 1.0,
        silence_s: float = 2.0,
        outbox_path: Path | None = None,
        zone: str = "",
        dispatch_records: bool = True,
    ) -> None:
        # Write each request's dispatch record (the `dispatches` bucket, made at start) before
        # queueing it: workers run, and billing takes a worker's usage for, dispatched requests only.
        self.dispatch_records = dispatch_records
        self.block_size = block_size
        self.zone = zone
        self.nc = nc
        self.kv = workers
        self.gateway_id = gateway_id
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_attempts = max_attempts
        self.placement_timeout_s = placement_timeout_s
        self.patience = patience.PlacementPatience(placement_timeout_s, placement_patience_s, time.monotonic)
        self.window = QueueWindow(window_per_worker)
        self.free_slots = free_slots
        # Whether a request of a band may wait on a worker's own queue (its expected wait there fits
        # the band's budget), given how many of ours already wait there unstarted.
        self.placement_fits = placement_fits
        self.on_started = on_started  # told each request's time from admission to its first token
        # Under contention requests wait here, not first-come-first-served in JetStream; only a few
        # per worker sit in the shared queue, enough that a freed slot always finds work.
        self.fair: FairQueue[Flight] = FairQueue()
        # Published and not yet accepted, by request id (few: the window and placed ones).
        self._queued_flights: dict[str, Flight] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.flights: dict[str, Flight] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self.replies = Replies(nc)
        self.liveness_timeout_s = liveness_timeout_s
        self.watch = WorkerWatch(self, self.replies, heartbeat_ttl_s=heartbeat_ttl_s, accept_timeout_s=accept_timeout_s,
                                liveness_timeout_s=liveness_timeout_s, silence_s=silence_s, free_slots=free_slots,
                                worker_free_slots=worker_free_slots)
        self.live_workers = self.watch.live_workers
        self.outbox = Outbox(outbox_path, self._publish_durable) if outbox_path is not None else None

    async def _publish_durable(self, subject: str, data: bytes, msg_id: str) -> None:
        subject = subjects.attributed_usage_subject(subject, subjects.USAGE_FROM_OWNER, self.gateway_id)
        await self.replies.publish_durable(subject, data, msg_id)

    async def start(self) -> None:
        if self.dispatch_records:
            await bus.dispatches_bucket(self.nc.jetstream())
        await self.replies.start()
        if self.outbox is not None:
            await self.outbox.start()
        self._sub = await self.nc.subscribe(
            subjects.event_filter(self.gateway_id), cb=bus.taking_turns(self._on_events), pending_msgs_limit=1_000_000,
            pending_bytes_limit=256 * 1024 * 1024,
        )
        self._watcher = await self.kv.watchall()
        self._tasks = [
            asyncio.create_task(self.watch.follow(self._watcher), name="watch-workers"),
            asyncio.create_task(self.watch.sweep(), name="sweep"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._watcher is not None:
            await self._watcher.stop()
        if self._sub is not None:
            await self._sub.unsubscribe()
        if self.outbox is not None:
            if not await self.outbox.drained(timeout=5):
                log.warning("usage_outbox_pending_at_exit", path=str(self.outbox.path))
            await self.outbox.stop()
        await self.replies.stop()

    def reply_subject(self) -> str:
        return subjects.token_subject(self.gateway_id)

    def engine_context_length(self, model: str) -> int:
        """The smallest context window the ready engines of `model` report (0: none reports one)."""
        windows = [beat.context_length for _, beat in self.live_workers.values()
                   if beat.model == model and beat.state == "ready" and beat.context_length > 0]
        return min(windows, default=0)

    def has_workers(self, model: str) -> bool:
        # A prefill worker serves decode workers only: a fleet of them alone runs no request.
        return any(beat.model == model and beat.state == "ready" and beat.role != "prefill"
                   for _, beat in self.live_workers.values())

    # ---- placement and publishing -----------------------------------------------------------

    async def _place(self, flight: Flight) -> m.PlacementReply:
        """Ask the router for a target; without an answer in time, the shared queue still serves
        (a pinned request: a worker of its release, `_unplaced`)."""
        lead = beside_lead(flight, self.live_workers, self._fits)
        if lead is not None:
            return lead
        ask = placement_question(flight, block_size=self.block_size, zone=self.zone, timeout_s=self.placement_timeout_s)
        if ask is None:
            return self._unplaced(flight)
        reply = await patience.ask(self.replies, subjects.placement_subject(flight.request.model), m.encode(ask),
                                   self.patience, _observe_placement)
        if reply is None:
            return self._unplaced(flight)
        try:
            placement = _placement_decoder.decode(reply.data)
        except msgspec.DecodeError:
            return self._unplaced(flight)
        verdict = judge_placement(placement, flight, self.live_workers, self._fits)
        if verdict == "over_budget":
            PLACEMENTS_OVER_BUDGET.inc()
        return placement if verdict == "take" and placement.worker_id else self._unplaced(flight)

    def _unplaced(self, flight: Flight) -> m.PlacementReply:
        """Where a request goes without a router's answer it can take: the shared queue, which a
        worker of any release pulls, except for a request pinned to a release (an eval run would
        otherwise score another release's answers): a worker of that release, else refused."""
        if not flight.request.release_pinned:
            return m.PlacementReply(target=subjects.ANY_TARGET)
        beats = {worker_id: beat for worker_id, (_, beat) in self.live_workers.items()}
        chosen = pinned_worker(flight, beats, lambda worker_id: self._queued_on(worker_id, flight.request.band),
                               self.zone)
        if chosen is None:
            raise DispatchError(503, "release_unavailable",
                                f"No worker of release {record.short(flight.request.release or '')} is serving "
                                f"`{flight.request.model}` right now.", retry_after=5)
        PLACEMENTS_PINNED.inc()
        return chosen

    def _fits(self, worker_id: str, band: str) -> bool:
        return self.placement_fits(worker_id, band, self._queued_on(worker_id, band))

    def _queued_on(self, worker_id: str, band: str) -> int:
        """This gateway's requests of `band` or a more important band queued on `worker_id`'s own
        queue and not started yet."""
        ahead = bands.through(band)
        return sum(1 for f in self._queued_flights.values() if f.worker_id == worker_id and f.request.band in ahead)

    async def _publish(self, flight: Flight) -> None:
        request = flight.request
        placement = await self._place(flight)
        # A request queued for one worker is that worker's from now on: if it dies before pulling
        # it, the request migrates like an accepted one instead of waiting out its deadline.
        flight.worker_id = placement.worker_id
        flight.placed_at = time.monotonic()
        if placement.cached_blocks:
            request = flight.request = msgspec.structs.replace(
                request, expected_cached_tokens=placement.cached_blocks * self.block_size
            )
        if placement.prefill_worker_id or request.prefill_worker:  # a disaggregated pair (or not, this attempt)
            request = flight.request = msgspec.structs.replace(
                request, prefill_worker=placement.prefill_worker_id,
                prefill_cached_tokens=placement.prefill_cached_blocks * self.block_size)
        PLACEMENTS.labels("worker" if placement.worker_id else "any").inc()
        subject = subjects.request_subject(request.band, request.model, placement.target,  # type: ignore[arg-type]
                                           request.reply_to)
        payload = m.encode(request.on_wire())
        if len(payload) > self.replies.max_payload:
            raise DispatchError(413, "request_too_large",
                                f"The request is {len(payload):,} bytes on the bus, over the platform's limit of "
                                f"{self.replies.max_payload:,}; shorten the prompt.")
        if self.dispatch_records:
            await dispatch_records.publish(self.replies, request)
        await self.replies.publish_durable(subject, payload, f"{request.request_id}.{request.attempt}",
                                           headers=tracing.inject())

    def _window_room(self) -> int:
        return self.window.room(len(self.live_workers), self.free_slots())

    def held(self, band: str) -> int:
        """Requests of `band` waiting in this gateway's fair queue."""
        return self.fair.waiting(band)

    def unstarted_ages(self, ahead: tuple[str, ...]) -> list[float]:
        """Seconds since admission of this gateway's requests of the bands `ahead` that have no first token yet.
        Only those whose wait measures load (`measures_load`)."""
        now = time.monotonic()
        return [now - f.opened_at for f in self.flights.values()
                if not f.started and f.request.band in ahead and self.measures_load(f, now)]

    def oldest_waiting_s(self, ahead: tuple[str, ...]) -> float:
        """Seconds the longest-waiting of this gateway's requests of the bands `ahead` has waited for a worker
        (held in the fair queue or queued in JetStream, not accepted yet); 0 when none waits.
        Only those whose wait measures load (`measures_load`)."""
        now = time.monotonic()
        return max((now - f.waiting_since for f in self.flights.values()
                    if f.state != "accepted" and f.request.band in ahead and self.measures_load(f, now)), default=0.0)

    def measures_load(self, flight: Flight, now: float) -> bool:
        """Whether `flight`'s wait says how loaded the fleet is (`flight.measures_load`)."""
        seen = self.live_workers.get(flight.worker_id) if flight.worker_id is not None else None
        return measures_load(flight, now, seen, self.heartbeat_ttl_s)

    def queued(self, band: str) -> int:
        """Requests of `band` this gateway published that no worker has accepted yet (known at
        once, where the queue depth the overload policy polls lags)."""
        return self.window.queued(band)

    async def open(self, request: m.InferenceRequest, weight: float = 1.0, block_hashes: list[int] | None = None,
                   follows: Flight | None = None) -> Flight:
        """Queue a new request; its events arrive on the returned flight's queue. `follows`: a
        flight to place it beside (the first choice of an n-choice request).

        With room in the window it is published now (a failure raises DispatchError); otherwise
        it waits in the fair queue and is published when its turn comes.
        """
        estimate = float((request.prompt_tokens or 0) + request.sampling.max_new_tokens)
        flight = Flight(request=request, prompt_tokens=request.prompt_tokens, weight=weight, estimated_tokens=estimate,
                        block_hashes=block_hashes or [], follows=follows)
        self.flights[request.request_id] = flight
        if self._window_room() > 0 and not len(self.fair):
            self.fair.dispatched(request.tenant, request.band, weight, estimate)
            self._mark_queued(flight)
            try:
                await self._publish(flight)
            except DispatchError:
                self.close(flight)
                raise
            except Exception as error:
                self.close(flight)
                log.error("publish_failed", error=repr(error))
                raise DispatchError(503, "service_unavailable", "The request queue is unavailable; retry shortly.",
                                    retry_after=1) from error
        else:
            self.fair.push(flight, request.tenant, request.band, weight)
            FAIR_QUEUE.set(len(self.fair))
        return flight

    def _mark_queued(self, flight: Flight) -> None:
        flight.state = "queued"
        self.window.entered(flight.request.band)
        self._queued_flights[flight.request.request_id] = flight

    def _left_queue(self, flight: Flight) -> None:
        if flight.state == "queued":
            self.window.left(flight.request.band)
            self._queued_flights.pop(flight.request.request_id, None)
        flight.state = "accepted"
        self._release()

    def _release(self) -> None:
        """Publish waiting requests, in fair order, while the window has room."""
        while self._window_room() > 0 and len(self.fair):
            popped = self.fair.pop(cost=lambda f: f.estimated_tokens)
            if popped is None:
                return
            flight = popped[0]
            self._mark_queued(flight)
            task = asyncio.ensure_future(self._publish_released(flight))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        FAIR_QUEUE.set(len(self.fair))

    async def _publish_released(self, flight: Flight) -> None:
        try:
            await self._publish(flight)
        except DispatchError as error:
            flight.events.put_nowait(m.StreamError(
                request_id=flight.request.request_id, attempt=flight.request.attempt, code=error.code,
                message=str(error), status=error.status,
            ))
        except Exception as error:
            log.error("publish_failed", request_id=flight.request.request_id, error=repr(error))
            flight.events.put_nowait(m.StreamError(
                request_id=flight.request.request_id, attempt=flight.request.attempt, code="service_unavailable",
                message="The request queue is unavailable; retry shortly.", status=503,
            ))

    def close(self, flight: Flight) -> None:
        request = flight.request
        if self.flights.pop(request.request_id, None) is None:
            return
        if flight.state == "held":
            self.fair.remove(flight, request.tenant, request.band)
        else:
            if flight.state == "queued":
                self.window.left(request.band)
                self._queued_flights.pop(request.request_id, None)
            used = float((flight.prompt_tokens or 0) + flight.sent_tokens)
            self.fair.finished(request.tenant, request.band, flight.estimated_tokens, used)
        self._release()

    async def supersede(self, flight: Flight) -> None:
        """Tell whichever worker holds (or will pull) the current attempt that it is given up."""
        cancel = m.Cancel(request_id=flight.request.request_id, reason="superseded", attempt=flight.request.attempt)
        try:
            await self.nc.publish(subjects.cancel_subject(self.gateway_id, flight.request.request_id), m.encode(cancel))
        except Exception as error:
            log.warning("cancel_publish_failed", error=repr(error))

    async def cancel(self, flight: Flight, reason: str, delivered_tokens: int = -1) -> None:
        """Stop every attempt of `flight`; `delivered_tokens`: what its client received, when known."""
        cancel = m.Cancel(request_id=flight.request.request_id, reason=reason,  # type: ignore[arg-type]
                          delivered_tokens=delivered_tokens)
        try:
            await self.nc.publish(subjects.cancel_subject(self.gateway_id, flight.request.request_id), m.encode(cancel))
        except Exception as error:
            log.warning("cancel_publish_failed", error=repr(error))

    async def migrate(self, flight: Flight, why: str) -> bool:
        """Continue `flight` on another worker; False when attempts or time ran out."""
        continuation = next_attempt(flight, self.max_attempts, time.time())
        if continuation is None:
            return False
        log.warning("migrating", request_id=continuation.request_id, attempt=continuation.attempt,
                    from_worker=flight.worker_id, why=why, resumed_tokens=continuation.resumed_tokens)
        MIGRATIONS.inc()
        # The old attempt may still run (a worker wrongly thought dead, a broken stream, one that
        # never started it): stop it, and it bills its work to the platform, not the tenant.
        await self.supersede(flight)
        flight.request = continuation
        flight.worker_id = None
        flight.orphaned_at = None
        flight.sent_text = []
        flight.sent_ids = []
        flight.next_seq = 0
        flight.resent_until = 0
        if flight.state != "queued":
            flight.waiting_since = time.monotonic()
            self._mark_queued(flight)  # waiting in a queue again, until a worker accepts it
        try:
            await self._publish(flight)
        except Exception as error:
            log.error("migration_publish_failed", error=repr(error))
            return False
        return True

    async def events(self, flight: Flight) -> AsyncIterator[m.StreamEvent]:
        """Events of the current attempt, in order, until a Final or a non-migratable error."""
        while True:
            event = await flight.events.get()
            if event.attempt != flight.request.attempt:
                continue  # a late event from an attempt already given up
            foreign = foreign_sender(flight, event)
            if foreign is not None:
                security_events.record("foreign_token_event", request_id=event.request_id, attempt=event.attempt,
                                       holder=flight.worker_id, sender=foreign, forged=type(event).__name__)
                continue
            if isinstance(event, m.Accepted):
                self._left_queue(flight)
                flight.worker_id = event.worker_id
                if flight.queue_wait is None:
                    flight.queue_wait = event.queue_wait
                continue
            if isinstance(event, (m.TokenChunk, m.Final)):
                if event.seq != flight.next_seq:
                    if shows_loss(flight, event.seq):
                        # Events went missing (core NATS drops what is in flight when a node dies or a
                        # connection moves): the worker sends them again from the first one missing,
                        # and this one after them.
                        self.recover(flight, why=f"stream gap: chunk {event.seq}, expected {flight.next_seq}")
                    continue  # below: a chunk sent again that had arrived after all
                flight.next_seq += 1
                if flight.state == "queued":  # its Accepted was lost: the output says it started
                    self._left_queue(flight)
                    flight.worker_id = event.worker_id or flight.worker_id
            if isinstance(event, (m.TokenChunk, m.Final)) and not flight.started:
                flight.started = True
                if flight.request.attempt == 0 and not flight.disrupted:  # else the wait is a failure's
                    self.on_started(flight.request.band, time.monotonic() - flight.opened_at)
            if isinstance(event, m.TokenChunk):
                if event.prompt_tokens is not None and flight.prompt_tokens is None:
                    flight.prompt_tokens = event.prompt_tokens
                flight.sent_text.append(event.text)
                flight.sent_ids.extend(event.token_ids)
                flight.sent_tokens = event.completion_tokens
                yield event
                continue
            if isinstance(event, m.StreamError) and event.code == "stream_lost":
                if await self.migrate(flight, why=event.message):
                    continue
                yield m.StreamError(request_id=event.request_id, attempt=event.attempt, code="stream_interrupted",
                                    message="The token stream was interrupted; retry the request.", status=502)
                return
            if isinstance(event, m.Handoff) or (isinstance(event, m.StreamError) and event.retryable):
                if await self.migrate(flight, why="handoff" if isinstance(event, m.Handoff) else event.code):
                    continue
            if (isinstance(event, m.StreamError) and event.code == "adapter_unavailable"
                    and flight.request.adapter_fallback and not flight.sent_ids and not flight.sent_text):
                # An adapter canary's candidate that cannot be loaded: the client gets the registered
                # version's answer; the candidate's failure is counted by its worker for the SLO gate.
                flight.request = msgspec.structs.replace(flight.request, adapter=flight.request.adapter_fallback,
                                                         adapter_fallback=None)
                if await self.migrate(flight, why=f"adapter candidate unavailable: {event.message}"):
                    continue
            yield event
            if isinstance(event, (m.Final, m.StreamError, m.Handoff)):
                return

    async def publish_usage(self, flight: Flight, status: str, finish: str | None, delivered_tokens: int) -> None:
        """For requests that ended in an error: bill what the client received, once. With nothing
        delivered, nothing is billed (not even the prompt: the client got no answer for it)."""
        request = flight.request
        event = error_usage(flight, status, finish, delivered_tokens, time.time(), self.gateway_id)
        subject = subjects.usage_subject(request.tenant, subjects.USAGE_FROM_OWNER, self.gateway_id)
        data = m.encode(event)
        # Drawn once for this event: the outbox keeps it for its retries (see `m.usage_publish_id`).
        msg_id = m.usage_publish_id(event, f"{subjects.USAGE_FROM_OWNER}.{subjects.token(self.gateway_id)}",
                                    m.new_usage_nonce())
        try:
            if self.outbox is not None:
                await self.outbox.add(subject, data, msg_id)
            else:
                await self.replies.publish_durable(subject, data, msg_id)
        except (PublishError, NatsTimeoutError, OSError) as error:
            log.error("usage_publish_failed", request_id=request.request_id, error=repr(error))

    # ---- inbound ----------------------------------------------------------------------------

    async def _on_events(self, msg: Msg) -> None:
        try:
            batch = m.decode_stream_frame(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_stream_batch", subject=msg.subject)
            return
        flights, now = self.flights, time.monotonic()
        publisher = subjects.event_sender(msg.subject)
        for event in batch.events:
            flight = flights.get(event.request_id)
            if flight is None:
                continue
            why = foreign_publisher(flight, event, publisher)
            if why is not None:
                security_events.record("foreign_token_event", request_id=event.request_id, attempt=event.attempt,
                                       holder=flight.worker_id, publisher=publisher, why=why,
                                       forged=type(event).__name__)
                continue
            if event.attempt == flight.request.attempt and flight.publisher != (event.attempt, publisher):
                flight.publisher = (event.attempt, publisher)
            flight.heard_at = now
            flight.events.put_nowait(event)

    # ---- events lost on the bus -------------------------------------------------------------

    def recover(self, flight: Flight, why: str) -> None:
        """Ask the flight's worker to send the current attempt's events again from the first the
        gateway lacks; where it cannot (it no longer has them, or a gap goes unanswered), the
        request continues on another worker from what the client has."""
        if flight.resending:
            return
        flight.resending = True
        task = asyncio.ensure_future(self._resend(flight, why))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def reconnected(self) -> None:
        """This gateway's NATS connection came back: whatever its streams' workers sent meanwhile
        is lost. Ask for it now rather than at the next gap or silence, for queued requests too
        (a worker may have started one, its `Accepted` lost with the rest)."""
        for flight in list(self.flights.values()):
            if flight.state != "held" and flight.request.batch_id is None:
                self.recover(flight, why="gateway reconnected")

    async def _resend(self, flight: Flight, why: str) -> None:
        await resend(self.replies, flight, why, gateway_id=self.gateway_id, timeout_s=self.liveness_timeout_s,
                     worker_live=lambda worker_id: worker_id in self.live_workers,
                     still_open=lambda f: self.flights.get(f.request.request_id) is f)

