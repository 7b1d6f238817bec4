"""Events of a stream lost on the bus: the gateway asks the stream's worker to send them again from
the first one it lacks; when the worker cannot, the attempt fails with a retryable `stream_lost`
and the request continues on another worker from what the client has (`Dispatcher.events`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from inferbus.bus.replies import Replies
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from .flight import Flight
from .metrics import RESENDS

log = logs.get(__name__)

_resend_decoder = msgspec.msgpack.Decoder(m.ResendReply)


def events_lost(reply: m.ResendReply | None, started: bool, why: str, worker_live: bool) -> bool:
    """Whether the missing events are gone for good, given the answer (None: none came) of a worker
    that could not send them again. Not for a request no worker started (it is still queued; one
    never started is moved on), nor for mere silence from a worker that did not answer while its
    heartbeat lives (the heartbeat decides whether it is dead); a gap in the stream is a loss."""
    if not started:
        return False
    return not (reply is None and not why.startswith("stream gap") and worker_live)


async def resend(replies: Replies, flight: Flight, why: str, *, gateway_id: str, timeout_s: float,
                 worker_live: Callable[[str | None], bool], still_open: Callable[[Flight], bool]) -> None:
    """Ask for the current attempt's events from `flight.next_seq` on; if they are lost, put a
    retryable `stream_lost` on the flight's queue (when the flight is still open and on that attempt)."""
    request, from_seq, worker_id = flight.request, flight.next_seq, flight.worker_id
    started = flight.state == "accepted"
    ask = m.encode(m.ResendRequest(request_id=request.request_id, attempt=request.attempt, from_seq=from_seq))
    # Its worker, or, for a request no worker has reported starting yet, whichever holds it.
    subject = (subjects.resend_subject(worker_id, gateway_id) if worker_id is not None
               else subjects.holder_subject(gateway_id))
    reply: m.ResendReply | None = None
    try:
        reply = _resend_decoder.decode((await replies.request(subject, ask, timeout_s)).data)
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
        if flight.request is request:
            if flight.worker_id is None:
                flight.worker_id = reply.worker_id or None
            # Counts a trailing error or handoff too: at worst one chunk past them waits for the next.
            flight.resent_until = max(flight.resent_until, from_seq + reply.resent)
        if reply.resent:
            log.warning("stream_resent", request_id=request.request_id, worker_id=reply.worker_id, why=why,
                        from_seq=from_seq, resent=reply.resent, state=reply.state)
        return
    if not events_lost(reply, started, why, worker_live(worker_id)):
        return
    if flight.request is request and still_open(flight):
        flight.events.put_nowait(m.StreamError(
            request_id=request.request_id, attempt=request.attempt, code="stream_lost", retryable=True, status=503,
            message=f"{why}; worker {worker_id} cannot send the missing events again",
        ))
