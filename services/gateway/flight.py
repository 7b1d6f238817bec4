"""A client request in flight at the gateway, and the pure decisions about it, the time given:
its next attempt, whose events it takes, whether its wait measures the fleet's load, whether its
stream went silent or its worker never started it, and what it bills when it ends in an error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferbus.tokens import continuation
from proto import messages as m
from proto import subjects


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
    # Chunks below this were sent again at the last ask: their first copies, published before the
    # answer, can still arrive after it and are no sign of a new loss.
    resent_until: int = 0
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
    # Monotonic time a worker that may hold it unstarted (the one it was queued on, or any, for one
    # in the shared queue) was found dead or restarted (None: none was): see `not_started`.
    orphaned_at: float | None = None


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



def measures_load(flight: Flight, now: float, seen: tuple[float, m.Heartbeat] | None, heartbeat_ttl_s: float) -> bool:
    """Whether `flight`'s wait says how loaded the fleet is. Not a later attempt's or a disrupted
    one's (a failure delayed them), nor one queued on a worker (`seen`: when it was last heard
    from, its heartbeat) that is gone, not ready or silent for half the heartbeat TTL: it waits for
    that worker to be found dead, and shedding new requests for it would turn one stopped worker
    into refusals of work the others can take."""
    if flight.request.attempt > 0 or flight.disrupted:
        return False
    if flight.state != "queued" or flight.worker_id is None:
        return True
    return seen is not None and seen[1].state == "ready" and now - seen[0] <= heartbeat_ttl_s / 2


def shows_loss(flight: Flight, seq: int) -> bool:
    """Whether chunk `seq` of the current attempt shows that events before it went missing: it
    comes after the next one expected and was not already sent again at the last ask."""
    return seq > flight.next_seq and seq >= flight.resent_until


def went_silent(flight: Flight, now: float, silence_s: float) -> bool:
    """A started stream that heard nothing for `silence_s` with nothing left to read: its worker
    is asked whether events went missing (usually they did not: a long prefill, a full engine).
    Batch lines are not streamed to a client: never."""
    return (silence_s > 0 and flight.state == "accepted" and flight.worker_id is not None and not flight.resending
            and now - flight.heard_at > silence_s and flight.events.empty() and flight.request.batch_id is None)


def not_started(flight: Flight, now: float, accept_timeout_s: float, free_slots: Callable[[str], int | None],
                fleet_free_slots: int) -> bool:
    """A request queued on a worker that has not started it within `accept_timeout_s`, while that
    worker has free slots or reports nothing (`free_slots` of it None): it moves to the shared
    queue. A full worker keeps it: it starts it when a slot frees.

    An orphan (queued on a worker found dead or restarted, or in the shared queue then:
    `orphaned_at`) moves too when it has not started `accept_timeout_s` after that while the fleet
    has free slots. The router moves what was still in the dead worker's queue, and another worker
    starts it at once; but a worker killed after it took the request from a queue and before its
    `Accepted` arrived leaves nothing to move, and the request would wait for its client to give up."""
    if flight.state != "queued":
        return False
    if flight.worker_id is None:
        return (flight.orphaned_at is not None and now - flight.orphaned_at >= accept_timeout_s
                and fleet_free_slots > 0)
    if now - flight.placed_at < accept_timeout_s:
        return False
    return free_slots(flight.worker_id) != 0


def error_usage(flight: Flight, status: str, finish: str | None, delivered_tokens: int, finished: float,
                gateway_id: str) -> m.UsageEvent:
    """The usage event of a request that ended in an error: what the client received. With
    nothing delivered, nothing is billed (not even the prompt: the client got no answer for it);
    of an n > 1 request only the first choice bills the prompt."""
    request = flight.request
    usage = m.Usage(prompt_tokens=(flight.prompt_tokens or 0) if delivered_tokens and not request.choice else 0,
                    completion_tokens=delivered_tokens)
    return m.UsageEvent(
        request_id=request.request_id, tenant=request.tenant, model=request.model, adapter=request.adapter,
        band=request.band, status=status, usage=usage, started=request.created, finished=finished,  # type: ignore[arg-type]
        worker_id=flight.worker_id or "", attempts=request.attempt + 1, finish_reason=finish,
        api_key_id=request.api_key_id, batch_id=request.batch_id, attempt=request.attempt,
    )
