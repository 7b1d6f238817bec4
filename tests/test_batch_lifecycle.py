"""The batch service's status machine, without NATS: what each record calls for, and each write."""

from __future__ import annotations

import msgspec

from proto import messages as m
from services.batch import lifecycle
from services.batch.lifecycle import Step, next_step


def _record(status: str = "validating", **fields: object) -> m.BatchRecord:
    record = m.BatchRecord(id="batch_1", tenant="t", input_file_id="file_1", endpoint="/v1/chat/completions",
                           completion_window="24h", created_at=100, expires_at=100 + 86_400)  # type: ignore[call-arg]
    return msgspec.structs.replace(record, status=status, **fields)


def test_each_status_calls_for_its_step() -> None:
    assert next_step(_record("validating"), tracked=False, ended=False) == Step("validate")
    assert next_step(_record("in_progress"), tracked=False, ended=False) == Step("resume")
    assert next_step(_record("in_progress"), tracked=True, ended=False) is None  # feeding: the feed loop's
    assert next_step(_record("finalizing"), tracked=True, ended=False) == Step("finish", "completed")
    assert next_step(_record("cancelling"), tracked=False, ended=False) == Step("finish", "cancelled")
    # Over: a batch still tracked is let go; one not tracked needs nothing, whatever a late record says.
    assert next_step(_record("completed"), tracked=True, ended=True) == Step("untrack")
    assert next_step(_record("validating"), tracked=False, ended=True) is None
    assert next_step(_record("completed"), tracked=False, ended=False) is None


def test_a_tracked_batch_completes_once_every_line_has_a_result_or_expires() -> None:
    common = dict(feeding=True, loaded=True, now=50.0, expires_at=100.0)
    assert lifecycle.run_outcome(finishing=None, all_done=True, **common) == "completed"  # type: ignore[arg-type]
    assert lifecycle.run_outcome(finishing=None, all_done=False, **common) is None  # type: ignore[arg-type]
    # Results not replayed yet (after a restart): not done, whatever the counts say.
    assert lifecycle.run_outcome(finishing=None, feeding=True, loaded=False, all_done=True, now=50.0,
                                 expires_at=100.0) is None
    assert lifecycle.run_outcome(finishing=None, feeding=True, loaded=True, all_done=False, now=100.0,
                                 expires_at=100.0) == "expired"
    # A finish already decided stays decided (a failed one is retried).
    assert lifecycle.run_outcome(finishing="expired", all_done=True, **common) == "expired"  # type: ignore[arg-type]
    assert lifecycle.finishes_now(_record("in_progress"), "completed")
    assert lifecycle.finishes_now(_record("finalizing"), "expired")
    assert not lifecycle.finishes_now(_record("cancelling"), "expired")  # the cancel path finishes it
    assert not lifecycle.finishes_now(_record("in_progress"), None)
    assert (lifecycle.cancel_reason("expired"), lifecycle.cancel_reason("cancelled")) == ("deadline", "admin")


def test_writes_are_refused_once_the_record_moved_on() -> None:
    validating = _record("validating")
    started = lifecycle.in_progress(validating, model="m", total=3, now=110, expires_at=500)
    assert started is not None and (started.status, started.total, started.in_progress_at, started.expires_at) == (
        "in_progress", 3, 110, 500)
    assert lifecycle.in_progress(_record("cancelling"), model="m", total=3, now=110, expires_at=500) is None
    finalizing = lifecycle.finalizing(started, 120)
    assert finalizing is not None and finalizing.status == "finalizing" and finalizing.finalizing_at == 120
    assert lifecycle.finalizing(_record("cancelling"), 120) is None
    reopened = lifecycle.reopened(finalizing)
    assert reopened is not None and reopened.status == "in_progress" and reopened.finalizing_at is None
    assert lifecycle.reopened(started) is None
    errors = [m.BatchErrorEntry(code="file_not_found", message="gone")]
    assert lifecycle.failed(validating, errors, 130).status == "failed"  # type: ignore[union-attr]
    assert lifecycle.failed(_record("completed"), errors, 130) is None


def test_progress_and_the_final_record() -> None:
    running = _record("in_progress", total=3)
    usage = m.BatchUsage(input_tokens=10, output_tokens=20)
    moved = lifecycle.progress(running, 2, 1, usage)
    assert moved is not None and (moved.completed, moved.failed, moved.usage) == (2, 1, usage)
    assert lifecycle.progress(moved, 2, 1, usage) is None  # nothing changed: nothing to write
    assert lifecycle.progress(_record("expired"), 2, 1, usage) is None
    done = lifecycle.final(moved, "expired", completed=2, failed_lines=1, usage=usage, output_file_id="file_o",
                           error_file_id="file_e", now=200)
    assert done is not None and (done.status, done.expired_at, done.completed_at) == ("expired", 200, None)
    assert (done.output_file_id, done.error_file_id) == ("file_o", "file_e")
    assert lifecycle.final(done, "completed", completed=3, failed_lines=0, usage=usage, output_file_id=None,
                           error_file_id=None, now=300) is None


def test_a_finish_indexes_the_file_again_only_of_a_batch_with_lines_not_over() -> None:
    for status in ("in_progress", "finalizing", "cancelling"):
        assert lifecycle.indexes_to_finish(_record(status, total=3))
    assert not lifecycle.indexes_to_finish(_record("cancelling", total=0))  # cancelled while validating
    assert not lifecycle.indexes_to_finish(_record("completed", total=3))


def test_a_completing_batch_runs_again_the_lines_whose_results_the_stream_lost() -> None:
    assert lifecycle.lost_lines("completed", 4, {0: "r", 2: "r"}) == [1, 3]
    assert lifecycle.lost_lines("completed", 2, {0: "r", 1: "r"}) == []
    # Expired or cancelled: lines without a result end as such, nothing runs again.
    assert lifecycle.lost_lines("expired", 4, {0: "r"}) == []
    assert lifecycle.lost_lines("cancelled", 4, {}) == []
