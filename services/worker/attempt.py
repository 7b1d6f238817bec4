"""One attempt at a request on this worker, and how a batch line's attempt ends. Pure: the caller
passes `now`; no I/O.

A batch line's attempt ends in one of two ways: with the line's one result (completed, failed,
cancelled or expired), or back on the batch queue as the line's next attempt carrying the output
so far (it gave way to interactive work, the worker drained, a retryable engine failure). The
worker (`batch_lines`) and the fleet simulator ask `attempt_verdict` which; the worker builds the
result or the next attempt from its record of the attempt with `line_outcome`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from inferbus.tokens import continuation
from proto import messages as m

# (error code, message, HTTP status) of a line that ends without output.
Failure = tuple[str, str, int]
EXPIRED: Failure = ("batch_expired", "The line did not finish before its batch's completion window expired.", 408)
CANCELLED: Failure = ("batch_cancelled", "The batch was cancelled before this line finished.", 499)


@dataclass
class Attempt:
    """A request this worker took off the bus, until it reports or hands it on."""

    request: m.InferenceRequest
    task: asyncio.Task[None] | None = None  # held here: the event loop keeps only weak references
    started: float = field(default_factory=time.time)  # when this worker took it (unix seconds)
    pause_epoch: int = 0  # the worker's pause count when it took the request
    cancelled: bool = False
    cancel_reason: str = ""
    delivered_tokens: int = -1  # a client gone: what its gateway had written to it (-1: unknown)
    superseded: bool = False  # the gateway gave this attempt up and continues elsewhere
    handed_off: bool = False
    prefill_worker: str | None = None  # disaggregated: the prefill worker computing its prompt now
    prefilled: bool = False  # the engine has produced its first token
    first_token_at: float = 0.0
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
    usage_written: bool = False  # the tenant's usage event is in the outbox (before the Final was sent)

    @property
    def given_up(self) -> bool:
        """The gateway gave this attempt up (superseded it, or its deadline passed): it bills the
        tenant what the client received, and this attempt's work is the platform's."""
        return self.superseded or (self.cancelled and self.cancel_reason == "deadline")

    @property
    def preemptible(self) -> bool:
        """A batch line still running (not already giving way or cancelled)."""
        return self.request.batch_id is not None and self.requeue is None and not self.cancelled

    def work(self) -> m.Usage:
        """What this attempt computed: its prefill (when it got that far) and the tokens it made."""
        request = self.request
        prefilled = self.prefilled or self.completion > request.resumed_tokens
        return m.Usage(prompt_tokens=(self.prompt_tokens or 0) + request.resumed_tokens if prefilled else 0,
                       completion_tokens=max(0, self.completion - request.resumed_tokens),
                       cached_tokens=self.cached if prefilled else 0)


def give_up_earlier(running: dict[str, Attempt], request: m.InferenceRequest) -> Attempt | None:
    """An earlier attempt of `request` still running here, now given up, or None.

    A gateway publishes a request's next attempt only after giving up the one before, so that one's
    work is the platform's from then on. Both can reach one worker: a worker killed and restarted
    under its own id takes over the earlier attempt's redelivery (its old claim died with it) and
    is then handed the next. The caller aborts what this returns."""
    earlier = running.get(request.request_id)
    if earlier is None or earlier.request.attempt >= request.attempt or earlier.cancelled:
        return None
    earlier.cancelled = earlier.superseded = True
    earlier.cancel_reason = "superseded"
    return earlier


def forget(running: dict[str, Attempt], entry: Attempt) -> None:
    """`entry` ended: drop it from `running`, unless a later attempt of its request holds the place."""
    if running.get(entry.request.request_id) is entry:
        del running[entry.request.request_id]


@dataclass(frozen=True)
class Verdict:
    status: Literal["completed", "failed", "cancelled", "requeued"]
    failure: Failure | None = None  # why the line ended without output
    requeue: str | None = None  # why the line goes back on the queue


def attempt_verdict(
    *,
    now: float,
    deadline: float,
    attempt: int,
    max_attempts: int,
    finish: str | None,
    failure: Failure | None = None,
    cancelled: bool = False,
    cancel_reason: str = "",
    give_way: str | None = None,
    handed_off: bool = False,
) -> Verdict:
    """How a batch line's attempt ends.

    `finish`: the engine's finish reason, if the attempt finished; `failure`: a failure that ends
    the line (a retryable one leaves it None); `give_way`: why the line was asked to give way
    ("preempted", "drain"), if it was; `handed_off`: the worker gave it back while draining.
    """
    if cancelled:
        expired = cancel_reason == "deadline" or now >= deadline
        return Verdict("cancelled", failure=EXPIRED if expired else CANCELLED)
    if failure is None and finish in ("stop", "length"):
        return Verdict("completed")
    if failure is not None:
        return Verdict("failed", failure=failure)
    # Not finished: asked to give way (preempted, draining), the engine gave up on it (an abort
    # of its own), a retryable failure, or its deadline passed before it ran.
    reason = give_way or ("drain" if handed_off else "engine_error")
    if now >= deadline:
        return Verdict("failed", failure=EXPIRED)
    if reason == "engine_error" and attempt + 1 >= max_attempts:
        return Verdict("failed", failure=("engine_error", f"The line failed on {attempt + 1} attempts.", 502))
    return Verdict("requeued", requeue=reason)


def line_usage(entry: Attempt) -> m.Usage:
    """Tokens made for the line over all its attempts. Its prompt counts once some attempt ran it
    (earlier attempts report nothing: the attempt that ends the line reports the totals)."""
    ran = entry.prefilled or entry.request.resumed_tokens > 0
    return m.Usage(prompt_tokens=(entry.prompt_tokens or 0) if ran else 0, completion_tokens=entry.completion,
                   cached_tokens=entry.cached if ran else 0)


def line_result(entry: Attempt, now: float, worker_id: str, *, finish: str | None = None,
                failure: Failure | None = None) -> m.BatchLineResult:
    request = entry.request
    assert request.batch_id is not None
    result = m.BatchLineResult(
        batch_id=request.batch_id, line=request.batch_line, request_id=request.request_id,
        attempt=request.attempt, finished=now, worker_id=worker_id, usage=line_usage(entry),
    )
    if failure is None:
        result.text = request.resumed_text + "".join(entry.text_parts)
        result.finish_reason = finish
        result.matched_stop = entry.matched
    else:
        result.ok = False
        result.error_code, result.error_message, result.status = failure
        result.finish_reason = "abort" if failure[0] in (CANCELLED[0], EXPIRED[0]) else "error"
    return result


def line_outcome(
    entry: Attempt, finish: str | None, failure: Failure | None, *, now: float, max_attempts: int, worker_id: str,
) -> tuple[str, m.BatchLineResult | None, m.InferenceRequest | None]:
    """(status, the line's result, or the next attempt to queue instead) of a batch line's attempt."""
    request = entry.request
    verdict = attempt_verdict(
        now=now, deadline=request.deadline, attempt=request.attempt, max_attempts=max_attempts, finish=finish,
        failure=failure, cancelled=entry.cancelled, cancel_reason=entry.cancel_reason, give_way=entry.requeue,
        handed_off=entry.handed_off,
    )
    if verdict.status == "requeued":
        entry.requeue = verdict.requeue
        return "requeued", None, continuation.next_attempt(
            request, text="".join(entry.text_parts), token_ids=entry.token_ids, produced_tokens=entry.completion,
            prompt_tokens=entry.prompt_tokens,
        )
    result = line_result(entry, now, worker_id, finish=finish if verdict.status == "completed" else None,
                         failure=verdict.failure)
    return verdict.status, result, None



def bill_delivered(usage: m.Usage, delivered_tokens: int) -> tuple[m.Usage, int]:
    """A cancelled request's usage as its tenant is billed, and the completion tokens that are the
    platform's: a client that left is billed what its gateway had written to it (when the gateway
    said, `delivered_tokens` >= 0), never more than the engine made; what the engine made after
    that (before the abort reached it) no client received."""
    if delivered_tokens < 0 or usage.completion_tokens <= delivered_tokens:
        return usage, 0
    platform_tokens = usage.completion_tokens - delivered_tokens
    return msgspec.structs.replace(usage, completion_tokens=delivered_tokens), platform_tokens
