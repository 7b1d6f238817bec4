"""Whose result of a batch line counts. Pure.

A worker publishes a line's result on `inferbus.batchres.<batch>.w.<worker>`, and NATS binds that
last token to the publishing identity (per-pod identities, `inferbus up`), as it does the worker's
stream events (`inferbus.tok.<owner>.<worker>`). The batch service takes a worker's result only
from the worker that holds the line's attempt. The holder is the worker whose `Accepted` for the
attempt reached the batch service on the subject that names it (`accepted_refusal`: the event
must name its publisher, and a later `Accepted` of the same attempt by another worker replaces the
holder only once the holder's heartbeat ended: a take-over). A result of an attempt nobody is
known to hold yet (its `Accepted` travels another path and may come later) waits for it. Where
the service may have missed the
`Accepted` (a line in doubt after it started, a line not done when it reconnected to NATS: core
NATS messages are lost meanwhile), a result of an attempt with no known holder is judged by its
names alone, as billing judges usage without a claim; else those lines would all run again.
(Batch lines are not claimed in the `claims` bucket, and claims are the workers' own records
anyway.)

A result taken is recorded by the batch service on its own subject
(`inferbus.batchres.<batch>.o.batch-<id>`), where no worker may publish; every reader (the live
consumer, its replay after a restart, the output files) counts the first result per line on those
subjects only. So a replay decides as the live consumer did, whatever workers published, and a
refused result can never become a line's result later.
"""

from __future__ import annotations

from proto import messages as m
from proto import subjects

FOREIGN_BATCH_RESULT = "foreign_batch_result"  # the security event's kind

TAKE = "take"  # the holder's result: record it as the line's
DUPLICATE = "duplicate"  # the line has its result already (it ran twice): logged, not counted
NOT_HELD = "holder_unknown"  # nobody is known to hold the attempt yet: waits for its `Accepted`
# Any other verdict is a refusal that only a forgery explains: a security event.


def accepted_refusal(sender: str, accepted: m.Accepted, holder: str | None, holder_alive: bool) -> str | None:
    """Why an `Accepted` published by `sender` (the worker token its subject names) does not make
    `sender` the holder of its attempt, held by `holder` (None: nobody yet) whose heartbeat is
    `holder_alive`; None when it does."""
    if not accepted.worker_id or subjects.token(accepted.worker_id) != sender:
        return "names_another_worker"
    if holder is not None and holder != sender and holder_alive:
        return "attempt_held_by_another"
    return None


def verdict(sender: tuple[str, str] | None, result: m.BatchLineResult, batch_id: str, holder: str | None,
            done: bool, blind: bool = False) -> str:
    """What to do with `result`, published on a subject of `batch_id` naming `sender` (kind, token)
    while `holder` (a worker token, None: unknown) holds the attempt it reports and the line is
    `done` (has its result): TAKE, DUPLICATE, NOT_HELD, or why it is refused. `blind`: this service
    may have missed the line's `Accepted` (it was down, or disconnected, while the line was out);
    a result of an attempt with no known holder is then judged by its names alone."""
    if sender is None or sender[0] != subjects.RESULT_FROM_WORKER:
        return "not_a_worker_subject"
    if result.batch_id != batch_id or result.request_id != m.batch_request_id(batch_id, result.line):
        return "names_another_line"
    if not result.worker_id or subjects.token(result.worker_id) != sender[1]:
        return "names_another_worker"
    if holder is not None and holder != sender[1]:
        return "attempt_held_by_another"
    if done:
        return DUPLICATE
    if holder is None and not blind:
        return NOT_HELD
    return TAKE


def refused(why: str) -> bool:
    """Whether a verdict is a refusal (a security event)."""
    return why not in (TAKE, DUPLICATE, NOT_HELD)
