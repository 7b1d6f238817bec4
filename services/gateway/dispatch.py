"""Gateway side of a request's life on the bus: place, publish, relay events, migrate on failure.

One wildcard subscription per gateway receives every stream event meant for its requests. A
watch on the `workers` KV bucket tells which workers are alive; when the worker holding a request
dies (heartbeat expired or deleted) or hands it back, the request continues on another worker
from the prompt plus the text already sent, so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.bus import patience, security_events
from inferbus.bus.outbox import Outbox
from inferbus.bus.replies import PublishError, Replies
from inferbus.runtime import logs, tracing
from inferbus.runtime.records import decode_or_none
from inferbus.stores import dispatch_records
from inferbus.tokens import continuation
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE
from proto import bands, subjects
from proto import messages as m

from .fairness import FairQueue
from .metrics import (
    DEATH_VERDICTS,
    FAIR_QUEUE,
    MIGRATIONS,
    NOT_STARTED,
    PLACEMENT_SECONDS,
    PLACEMENTS,
    PLACEMENTS_OVER_BUDGET,
    RESENDS,
)
from .queue_window import QueueWindow

log = logs.get(__name__)

_heartbeat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)
_placement_decoder = msgspec.msgpack.Decoder(m.PlacementReply)
_liveness_decoder = msgspec.msgpack.Decoder(m.LivenessReply)
_resend_decoder = msgspec.msgpack.Decoder(m.ResendReply)


class DispatchError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


@dataclass
class Flight:
    """One client request in flight, across however many attempts it takes."""

    request: m.InferenceRequest
    events: asyncio.Queue[m.StreamEvent] = field(default_factory=asyncio.Queue)
    worker_id: str | None = None
    sent_text: list[str] = field(default_factory=list)
    sent_ids: list[int] = field(default_factory=list)  # token ids of sent_text, this attempt
    sent_tokens: int = 0
    prompt_tokens: int | None = None
    queue_wait: float | None = None
    next_seq: int = 0  # of the current attempt's chunks: a gap means events were lost
    heard_at: float = 0.0  # monotonic time an event of this request last arrived
    publisher: tuple[int, str] | None = None  # (attempt, worker token) that first published for the attempt
    resending: bool = False  # its worker was asked to send missed events again, no answer yet
    weight: float = 1.0  # the tenant's fair-share weight
    estimated_tokens: float = 0.0  # charged to the tenant's fair-share counter at dispatch
    state: str = "held"  # held (in the fair queue) → queued (in JetStream) → accepted (by a worker)
    block_hashes: list[int] = field(default_factory=list)  # the prompt's prefix blocks, for placement
    placed_at: float = 0.0  # monotonic time the current attempt was queued on a worker's own subject
    avoid_worker: str | None = None  # a worker that never started this request: not placed there again
    # Choice k > 0 of an n-choice request: placed where choice 0 went, whose engine will hold their
    # common prompt (one prefill for all n).
    follows: Flight | None = None
    opened_at: float = field(default_factory=time.monotonic)  # when the gateway admitted it
    started: bool = False  # its first token (or its Final) came, on any attempt
    waiting_since: float = field(default_factory=time.monotonic)  # held or queued since (a migration queues anew)
    # A worker's failure delayed it (it was queued on a worker found dead, or moved for not being
    # started): its wait is the failure's, not the load's, as for a later attempt.
    disrupted: bool = False


def next_attempt(flight: Flight, max_attempts: int, now: float) -> m.InferenceRequest | None:
    """The continuation of a failed attempt, or None when it must not be retried."""
    request = flight.request
    if request.attempt + 1 >= max_attempts or now >= request.deadline:
        return None
    if request.sampling.constrained and (flight.sent_tokens or request.resumed_tokens):
        return None  # the client has part of the output: the grammar would start over in its middle
    return continuation.next_attempt(request, text="".join(flight.sent_text), token_ids=flight.sent_ids,
                                     produced_tokens=flight.sent_tokens, prompt_tokens=flight.prompt_tokens)


def foreign_sender(flight: Flight, event: m.StreamEvent) -> str | None:
    """The worker an event of the flight's current attempt names when another worker holds that
    attempt (it reported starting it), else None. Only events that name their sender can be
    checked (`Accepted`, `Handoff`, a `Final`, a stream's first chunk); with role-wide credentials
    the name is the sender's own claim (docs/security.md)."""
    named = getattr(event, "worker_id", "")
    if not named or flight.state != "accepted" or not flight.worker_id:
        return None
    return named if named != flight.worker_id else None


def foreign_publisher(flight: Flight, event: m.StreamEvent, publisher: str) -> str | None:
    """Why an event published by `publisher` (the worker token its subject ends with, which NATS
    binds to the publishing identity) is not taken, else None. An event naming a worker must be
    its publisher's; an event of the current attempt must come from the worker that holds it
    (reported starting it) or, before one has, from the first worker that published for it."""
    named = getattr(event, "worker_id", "")
    if named and subjects.token(named) != publisher:
        return "names_another_worker"
    if event.attempt != flight.request.attempt:
        return None  # a late event of an attempt given up: dropped by the stream anyway
    if flight.state == "accepted" and flight.worker_id:
        return None if subjects.token(flight.worker_id) == publisher else "not_the_holder"
    if flight.publisher is not None and flight.publisher[0] == event.attempt and flight.publisher[1] != publisher:
        return "not_the_first_publisher"
    return None


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
        self.worker_free_slots = worker_free_slots  # a worker's free slots at its last load report, if recent
        # Whether a request of a band may wait on a worker's own queue (its expected wait there fits
        # the band's budget), given how many of ours already wait there unstarted.
        self.placement_fits = placement_fits
        self.on_started = on_started  # told each request's time from admission to its first token
        # Under contention requests wait here, not first-come-first-served in JetStream; only a few
        # per worker sit in the shared queue, enough that a freed slot always finds work.
        self.fair: FairQueue[Flight] = FairQueue()
        self._queued_flights: dict[str, Flight] = {}  # published and not yet accepted, by request id (few: the window and placed ones)
        self._background: set[asyncio.Task[None]] = set()
        self.flights: dict[str, Flight] = {}
        self.live_workers: dict[str, tuple[float, m.Heartbeat]] = {}  # id → (last seen, beat)
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self.replies = Replies(nc)
        # A request queued on a worker's own subject and not started by it within this long moves
        # to the shared queue; a worker whose heartbeat lapsed is asked (this long) before it is dead.
        self.accept_timeout_s = accept_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self._probing: set[str] = set()
        # A started stream that hears nothing for this long asks its worker whether it sent events
        # that never came (a stream's last events lost on the bus would hold its client until its
        # timeout: nothing later reveals the gap).
        self.silence_s = silence_s
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
            asyncio.create_task(self._watch_workers(), name="watch-workers"),
            asyncio.create_task(self._sweep(), name="sweep"),
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
        """Ask the router for a target; without an answer in time, the shared queue still serves."""
        request = flight.request
        shared = m.PlacementReply(target=subjects.ANY_TARGET)
        lead = flight.follows
        if (lead is not None and lead.worker_id and lead.worker_id in self.live_workers
                and lead.worker_id != flight.avoid_worker
                and self.placement_fits(lead.worker_id, request.band, self._queued_on(lead.worker_id, request.band))):
            return m.PlacementReply(target=subjects.worker_target(lead.worker_id), worker_id=lead.worker_id,
                                    reason="with choice 0", prefill_worker_id=lead.request.prefill_worker)
        if self.placement_timeout_s <= 0 or not (flight.block_hashes or request.adapter or request.release or self.zone):
            # Shorter than one prefix block, no adapter, no release and no zone to keep it in: no
            # cache to find, and balancing load is what the shared queue does anyway. Skipping the
            # round trip saves ~1 ms.
            return shared
        ask = m.PlacementRequest(
            request_id=request.request_id, model=request.model, adapter=request.adapter,
            prompt_tokens=(request.prompt_tokens or 0) + request.resumed_tokens, band=request.band,
            block_hashes=flight.block_hashes, block_size=self.block_size if flight.block_hashes else 0,
            release=request.release, pinned=request.release_pinned, zone=self.zone,
        )
        reply = await patience.ask(self.replies, subjects.placement_subject(request.model), m.encode(ask),
                                   self.patience, _observe_placement)
        if reply is None:
            return shared
        try:
            placement = _placement_decoder.decode(reply.data)
        except msgspec.DecodeError:
            return shared
        if placement.worker_id and (placement.worker_id not in self.live_workers or placement.worker_id == flight.avoid_worker):
            return shared
        if placement.worker_id and not self.placement_fits(placement.worker_id, request.band,
                                                           self._queued_on(placement.worker_id, request.band)):
            # That worker's queue would hold it past its band's budget: any worker may take it.
            PLACEMENTS_OVER_BUDGET.inc()
            return shared
        return placement

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
        """Whether `flight`'s wait says how loaded the fleet is. Not a later attempt's or a disrupted
        one's (a failure delayed them), nor one queued on a worker that is gone, not ready or silent
        for half the heartbeat TTL: it waits for that worker to be found dead, and shedding new
        requests for it would turn one stopped worker into refusals of work the others can take."""
        if flight.request.attempt > 0 or flight.disrupted:
            return False
        if flight.state != "queued" or flight.worker_id is None:
            return True
        seen = self.live_workers.get(flight.worker_id)
        return seen is not None and seen[1].state == "ready" and now - seen[0] <= self.heartbeat_ttl_s / 2

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
                raise DispatchError(503, "service_unavailable", "The request queue is unavailable; retry shortly.", retry_after=1) from error
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
        flight.sent_text = []
        flight.sent_ids = []
        flight.next_seq = 0
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
                    if event.seq > flight.next_seq:
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
        # n > 1: only the first choice bills the prompt.
        usage = m.Usage(prompt_tokens=(flight.prompt_tokens or 0) if delivered_tokens and not request.choice else 0,
                        completion_tokens=delivered_tokens)
        event = m.UsageEvent(
            request_id=request.request_id, tenant=request.tenant, model=request.model, adapter=request.adapter,
            band=request.band, status=status, usage=usage, started=request.created, finished=time.time(),  # type: ignore[arg-type]
            worker_id=flight.worker_id or "", attempts=request.attempt + 1, finish_reason=finish,
            api_key_id=request.api_key_id, batch_id=request.batch_id, attempt=request.attempt,
        )
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
        request, from_seq, worker_id = flight.request, flight.next_seq, flight.worker_id
        started = flight.state == "accepted"
        ask = m.encode(m.ResendRequest(request_id=request.request_id, attempt=request.attempt, from_seq=from_seq))
        # Its worker, or, for a request no worker has reported starting yet, whichever holds it.
        subject = (subjects.resend_subject(worker_id, self.gateway_id) if worker_id is not None
                   else subjects.holder_subject(self.gateway_id))
        reply: m.ResendReply | None = None
        try:
            reply = _resend_decoder.decode((await self.replies.request(subject, ask, self.liveness_timeout_s)).data)
        except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError):
            pass
        except Exception as error:  # the bus itself failed: ask again at the next silence
            log.warning("resend_request_failed", request_id=request.request_id, error=repr(error))
            return
        finally:
            flight.resending = False
            flight.heard_at = time.monotonic()
        RESENDS.labels(reply.state if reply is not None else "no_answer").inc()
        if reply is not None and reply.state != "unknown":
            if flight.worker_id is None and flight.request is request:
                flight.worker_id = reply.worker_id or None
            if reply.resent:
                log.warning("stream_resent", request_id=request.request_id, worker_id=reply.worker_id, why=why,
                            from_seq=from_seq, resent=reply.resent, state=reply.state)
            return
        if not started:
            return  # no worker has it: it is still queued (a worker that never starts it is moved on)
        if reply is None and not why.startswith("stream gap") and worker_id in self.live_workers:
            return  # silence, and the worker did not answer: its heartbeat decides whether it is dead
        if flight.request is request and self.flights.get(request.request_id) is flight:
            flight.events.put_nowait(m.StreamError(
                request_id=request.request_id, attempt=request.attempt, code="stream_lost", retryable=True, status=503,
                message=f"{why}; worker {worker_id} cannot send the missing events again",
            ))

    async def _watch_workers(self) -> None:
        assert self._watcher is not None
        await bus.follow(self._watcher, self._on_heartbeat, self._worker_gone)

    def _on_heartbeat(self, entry: KeyValue.Entry) -> None:
        beat = decode_or_none(_heartbeat_decoder, entry.value or b"", store="workers", key=entry.key)
        if beat is None:
            return
        self.live_workers[beat.worker_id] = (time.monotonic(), beat)

    def _worker_gone(self, key: str) -> None:
        """A heartbeat lapsed: ask the worker before declaring it dead (migrating live streams of
        a busy but healthy worker costs more than a second's wait)."""
        for worker_id in [wid for wid in self.live_workers if subjects.worker_key(wid) == key]:
            if worker_id in self._probing:
                continue
            self._probing.add(worker_id)
            task = asyncio.ensure_future(self._verdict(worker_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _verdict(self, worker_id: str) -> None:
        try:
            alive = await self._answers(worker_id)
        finally:
            self._probing.discard(worker_id)
        if alive:
            DEATH_VERDICTS.labels("alive").inc()
            seen = self.live_workers.get(worker_id)
            if seen is not None:  # its heartbeat will be back; until then the sweep waits again
                self.live_workers[worker_id] = (time.monotonic(), seen[1])
            log.warning("worker_heartbeat_late_but_alive", worker_id=worker_id)
            return
        DEATH_VERDICTS.labels("dead").inc()
        self._declare_dead(subjects.worker_key(worker_id))

    async def _answers(self, worker_id: str) -> bool:
        probe = m.encode(m.LivenessProbe(worker_id=worker_id))
        try:
            reply = await self.replies.request(subjects.liveness_subject(worker_id), probe, self.liveness_timeout_s)
            return _liveness_decoder.decode(reply.data).worker_id == worker_id
        except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError):
            return False
        except Exception as error:  # the bus itself failed: we cannot tell, so do not kill anything
            log.warning("liveness_probe_failed", worker_id=worker_id, error=repr(error))
            return True

    def _declare_dead(self, key: str) -> None:
        gone = [wid for wid in self.live_workers if subjects.worker_key(wid) == key]
        for worker_id in gone:
            del self.live_workers[worker_id]
            log.warning("worker_gone", worker_id=worker_id)
        for flight in list(self.flights.values()):
            if flight.worker_id not in gone:
                continue
            if flight.state == "queued":
                # Still in the dead worker's queue: the router moves it to the shared queue, where
                # another worker takes it. Publishing a second attempt here would run it twice.
                flight.worker_id = None
                flight.disrupted = True
            else:
                self._fail_attempt(flight, "worker heartbeat ended")

    def _fail_attempt(self, flight: Flight, why: str) -> None:
        # A synthetic retryable error on the flight's own queue: the reader migrates in order.
        flight.events.put_nowait(m.StreamError(
            request_id=flight.request.request_id, attempt=flight.request.attempt, code="worker_lost",
            message=f"worker {flight.worker_id} stopped responding ({why})", retryable=True, status=503,
        ))
        flight.worker_id = None

    async def _sweep(self) -> None:
        # Backstop for expiries whose delete marker we missed (e.g. across a NATS reconnect).
        while True:
            await asyncio.sleep(min(0.5, self.heartbeat_ttl_s / 4))
            now = time.monotonic()
            dead = [wid for wid, (seen, _) in self.live_workers.items() if now - seen > self.heartbeat_ttl_s * 1.5]
            for worker_id in dead:
                self._worker_gone(subjects.worker_key(worker_id))
            self._move_unstarted(now)
            self._ask_silent(now)

    def _ask_silent(self, now: float) -> None:
        """A started stream that heard nothing for `silence_s` with nothing left to read asks its
        worker whether events went missing (usually they did not: a long prefill, a full engine)."""
        if self.silence_s <= 0:
            return
        for flight in list(self.flights.values()):
            if (flight.state == "accepted" and flight.worker_id is not None and not flight.resending
                    and now - flight.heard_at > self.silence_s and flight.events.empty()
                    and flight.request.batch_id is None):
                self.recover(flight, why=f"no event for {now - flight.heard_at:.1f} s")

    def _move_unstarted(self, now: float) -> None:
        """A request queued on a worker that has not started it within `accept_timeout_s`, while
        that worker has free slots or reports nothing, moves to the shared queue: a worker that
        pulls nothing (a zombie, a lost consumer) must not hold its client until the deadline. A
        full worker keeps it: it starts it when a slot frees. The old attempt is superseded, so
        it never runs twice."""
        for flight in list(self.flights.values()):
            if flight.state != "queued" or flight.worker_id is None or now - flight.placed_at < self.accept_timeout_s:
                continue
            if self.worker_free_slots(flight.worker_id) == 0:
                continue
            NOT_STARTED.inc()
            log.warning("request_not_started", request_id=flight.request.request_id, worker_id=flight.worker_id,
                        waited_s=round(now - flight.placed_at, 2))
            flight.avoid_worker = flight.worker_id
            flight.disrupted = True
            flight.placed_at = now  # one move per timeout, whatever the reader is doing
            flight.events.put_nowait(m.StreamError(
                request_id=flight.request.request_id, attempt=flight.request.attempt, code="not_started",
                message=f"worker {flight.worker_id} did not start the request", retryable=True, status=503,
            ))

