"""A batch's status machine: what the batch service does next for a batch, and each change it
writes to the batch's record. Pure: records and times in, records (or nothing to write) out.

    validating ──validate──▶ in_progress ──all lines have a result──▶ finalizing ──files──▶ completed
        │                        │  ▲                                      │
        └──invalid──▶ failed     │  └───────── results lost (reopen) ◀─────┘
                                 ├──expires_at passed──▶ expired
    (gateway) any non-final ──▶ cancelling ──────────────▶ cancelled

Every change is written compare-and-set against the record as it is now (`changes` below return
None when the record has moved on and there is nothing to write), so the gateway's cancel and the
service's progress never overwrite each other. The service shell (`service`, and `finishing` for
the end) does the I/O each step calls for: validating the file, tracking lines, writing output files.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import msgspec

from proto import messages as m

Outcome = Literal["completed", "expired", "cancelled"]
_STAMPS: dict[str, str] = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}


@dataclass(frozen=True)
class Step:
    """One step of a batch the service runs (one at a time per batch)."""

    kind: Literal["validate", "resume", "finish", "untrack"]
    outcome: Outcome | None = None  # for "finish"


def next_step(record: m.BatchRecord, *, tracked: bool, ended: bool) -> Step | None:
    """What the batch's newest record calls for. `tracked`: this process runs its lines; `ended`:
    it reached a final status (this process saw it)."""
    if ended and not tracked:
        return None
    if record.status == "validating":
        return Step("validate")
    if record.status == "in_progress" and not tracked:
        return Step("resume")  # started by an earlier process: index its file again and go on
    if record.status == "finalizing":
        return Step("finish", "completed")
    if record.status == "cancelling":
        return Step("finish", "cancelled")
    if ended and tracked:
        return Step("untrack")
    return None


def run_outcome(*, finishing: str | None, feeding: bool, loaded: bool, all_done: bool, now: float,
                expires_at: float) -> Outcome | None:
    """How a tracked batch ends, checked every feed tick: completed once every line has a result
    (and the results stream has been replayed), expired once its window has passed."""
    if finishing is not None:
        return finishing  # type: ignore[return-value]  # already decided; a failed finish is retried
    if feeding and loaded and all_done:
        return "completed"
    if now >= expires_at:
        return "expired"
    return None


def finishes_now(record: m.BatchRecord, outcome: Outcome | None) -> bool:
    """Whether the finish of a tracked batch runs now (a cancel has its own path)."""
    return outcome is not None and record.status in ("in_progress", "finalizing")


def cancel_reason(outcome: Outcome) -> str:
    """Why lines still out in the fleet are cancelled when a batch ends before they did."""
    return "deadline" if outcome == "expired" else "admin"


def indexes_to_finish(record: m.BatchRecord) -> bool:
    """Whether the finish of a batch this process does not track (it restarted mid-finalize or
    mid-cancel) indexes its input file again first, to know its lines: a batch that has lines and
    is not over."""
    return record.total > 0 and record.status in ("finalizing", "cancelling", "in_progress")


def lost_lines(outcome: Outcome, total: int, results: Collection[int]) -> list[int]:
    """The lines of a completing batch (`total` lines) without a result in the stream, which holds
    a result for each of `results`: the stream is the record of what ended, so those lines run
    again (a NATS server killed hard loses its last writes). None when the batch expired or was
    cancelled: lines without a result end as such."""
    if outcome != "completed":
        return []
    return [line for line in range(total) if line not in results]


# ---- the changes written to the record (None: nothing to write) ------------------------------

def failed(current: m.BatchRecord, errors: list[m.BatchErrorEntry], now: int) -> m.BatchRecord | None:
    if current.status in m.BATCH_TERMINAL:
        return None
    return msgspec.structs.replace(current, status="failed", errors=errors, failed_at=now)


def in_progress(current: m.BatchRecord, *, model: str, total: int, now: int, expires_at: int) -> m.BatchRecord | None:
    if current.status != "validating":
        return None  # cancelled meanwhile: the cancel path takes it from here
    return msgspec.structs.replace(current, status="in_progress", model=model, total=total, in_progress_at=now,
                                   expires_at=expires_at)


def finalizing(current: m.BatchRecord, now: int) -> m.BatchRecord | None:
    if current.status != "in_progress":
        return None  # cancelled meanwhile: that path finishes it
    return msgspec.structs.replace(current, status="finalizing", finalizing_at=now)


def reopened(current: m.BatchRecord) -> m.BatchRecord | None:
    """Results the service counted are not in the stream: the batch runs those lines again."""
    if current.status != "finalizing":
        return None
    return msgspec.structs.replace(current, status="in_progress", finalizing_at=None)


def progress(current: m.BatchRecord, completed: int, failed_lines: int, usage: m.BatchUsage) -> m.BatchRecord | None:
    if current.status in m.BATCH_TERMINAL:
        return None
    if (current.completed, current.failed, current.usage) == (completed, failed_lines, usage):
        return None
    return msgspec.structs.replace(current, completed=completed, failed=failed_lines, usage=usage)


def final(current: m.BatchRecord, outcome: Outcome, *, completed: int, failed_lines: int, usage: m.BatchUsage,
          output_file_id: str | None, error_file_id: str | None, now: int) -> m.BatchRecord | None:
    if current.status in m.BATCH_TERMINAL:
        return None
    return msgspec.structs.replace(
        current, status=outcome, completed=completed, failed=failed_lines, usage=usage,
        output_file_id=output_file_id, error_file_id=error_file_id, **{_STAMPS[outcome]: now},
    )
