"""Whether a line a worker hands back (preempted, draining, a retryable failure) may be queued
again: the batch service queues its lines' next attempts itself, so no worker identity needs the
right to create batch work. Pure: `refusal` judges the request against the batch it names."""

from __future__ import annotations

from proto import messages as m

from .tracker import ActiveBatch, parse_request_id

# Why a handed-back line is not queued. `FORGED` ones could only come from a worker speaking for
# work it was not given (a security event); the others are lines whose batch moved on meanwhile.
FORGED = frozenset({"not_a_batch_line", "another_tenant", "another_owner", "another_model"})


def refusal(request: m.InferenceRequest, run: ActiveBatch | None, reply_subject: str) -> str | None:
    """Why `request`, a line's next attempt handed back by a worker, is not queued (None: queue it);
    `run` is the batch its request id names, if this service runs it."""
    parsed = parse_request_id(request.request_id)
    if (parsed is None or request.band != "batch" or request.batch_id != parsed[0]
            or request.batch_line != parsed[1]):
        return "not_a_batch_line"
    if run is None:
        return "batch_not_running"  # ended, or another batch service's
    if request.reply_to != reply_subject:
        return "another_owner"
    if request.tenant != run.record.tenant or request.api_key_id != run.record.api_key_id:
        return "another_tenant"
    if request.model != run.base_model or request.adapter != run.adapter:
        return "another_model"
    if not 0 <= parsed[1] < run.total:
        return "not_a_batch_line"
    if not run.feeding or parsed[1] in run.done:
        return "line_over"  # cancelled, expiring, or its result is in
    return None
