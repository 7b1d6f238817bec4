"""Whose result of a batch line counts (`services/batch/results.py`, the tracker's holders): the
decision's tables. The same rules on a real platform: `tests/test_e2e_batch.py`
(`test_only_the_holder_of_a_lines_attempt_gives_its_result`)."""

from __future__ import annotations

import msgspec
import pytest

from proto import messages as m
from proto import subjects
from services.batch.results import DUPLICATE, NOT_HELD, TAKE, accepted_refusal, refused, verdict
from services.batch.tracker import ActiveBatch, Tracker

W, O = subjects.RESULT_FROM_WORKER, subjects.RESULT_FROM_OWNER


def result(worker_id: str = "worker-1", line: int = 0, batch_id: str = "batch_x",
           **fields: object) -> m.BatchLineResult:
    return m.BatchLineResult(batch_id=batch_id, line=line, request_id=m.batch_request_id(batch_id, line), attempt=0,
                             finished=0.0, worker_id=worker_id, text="ok", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("sender", "named", "holder", "done", "why"), [
    ((W, "worker-1"), "worker-1", "worker-1", False, TAKE),  # control: the holder's own
    ((W, "worker-1"), "worker-1", "worker-1", True, DUPLICATE),  # the line ran twice
    ((W, "worker-1"), "worker-1", None, False, NOT_HELD),  # nobody known to hold it: the line runs again
    ((W, "worker-2"), "worker-2", "worker-1", False, "attempt_held_by_another"),
    ((W, "worker-2"), "worker-2", "worker-1", True, "attempt_held_by_another"),  # a forgery even once done
    ((W, "worker-2"), "worker-1", "worker-1", False, "names_another_worker"),  # naming the holder
    ((W, "worker-2"), "", None, False, "names_another_worker"),
    ((O, "batch-main"), "worker-1", "worker-1", False, "not_a_worker_subject"),
    (None, "worker-1", "worker-1", False, "not_a_worker_subject"),  # the layout before senders were named
])
def test_a_result_counts_only_from_the_holder_of_its_attempt(sender: tuple[str, str] | None, named: str,
                                                             holder: str | None, done: bool, why: str) -> None:
    assert verdict(sender, result(named), "batch_x", holder, done) == why
    assert refused(why) == (why not in (TAKE, DUPLICATE, NOT_HELD))


def test_a_result_names_its_own_batch_and_line() -> None:
    other_batch = result(batch_id="batch_y")
    assert verdict((W, "worker-1"), other_batch, "batch_x", "worker-1", False) == "names_another_line"
    wrong_id = msgspec.structs.replace(result(line=1), request_id=m.batch_request_id("batch_x", 2))
    assert verdict((W, "worker-1"), wrong_id, "batch_x", "worker-1", False) == "names_another_line"


def accepted(worker_id: str, attempt: int = 0, line: int = 0) -> m.Accepted:
    return m.Accepted(request_id=m.batch_request_id("batch_x", line), attempt=attempt, worker_id=worker_id,
                      queue_wait=0.0)


@pytest.mark.parametrize(("sender", "named", "holder", "alive", "why"), [
    ("worker-1", "worker-1", None, False, None),  # the first to accept the attempt holds it
    ("worker-1", "worker-1", "worker-1", True, None),  # said again
    ("worker-2", "worker-2", "worker-1", True, "attempt_held_by_another"),
    ("worker-2", "worker-2", "worker-1", False, None),  # a take-over: the holder's heartbeat ended
    ("worker-2", "worker-1", None, False, "names_another_worker"),
    ("", "worker-1", None, False, "names_another_worker"),  # a subject naming nobody
])
def test_an_accepted_makes_its_publisher_the_holder_unless_a_live_worker_holds_it(
        sender: str, named: str, holder: str | None, alive: bool, why: str | None) -> None:
    assert accepted_refusal(sender, accepted(named), holder, alive) == why


def run_of(total: int = 3) -> tuple[Tracker, ActiveBatch]:
    tracker = Tracker(60.0)
    record = m.BatchRecord(id="batch_x", tenant="acme", input_file_id="f", endpoint="/v1/chat/completions",
                           completion_window="24h", created_at=0, expires_at=0, status="in_progress")
    run = ActiveBatch(record=record,
                      custom_ids=[f"c{i}" for i in range(total)], offsets=[0] * total, base_model="m", loaded=True)
    tracker.add(run, resumed=False)
    return tracker, run


def test_the_tracker_knows_each_attempts_holder_from_its_accepted() -> None:
    tracker, run = run_of()
    live = {"worker-1"}
    assert tracker.on_accepted(accepted("worker-1"), 1.0, "worker-1", live.__contains__) is None
    assert tracker.holder("batch_x", 0, 0) == "worker-1"
    # worker-2 says it took the same attempt, under its name, while worker-1 lives: refused.
    assert tracker.on_accepted(accepted("worker-2"), 2.0, "worker-2", live.__contains__) == "attempt_held_by_another"
    assert tracker.holder("batch_x", 0, 0) == "worker-1" and run.outstanding[0].worker_id == "worker-1"
    # An `Accepted` naming worker-1 published by worker-2: refused, no holder for attempt 1.
    refused = tracker.on_accepted(accepted("worker-1", attempt=1), 2.0, "worker-2", live.__contains__)
    assert refused == "names_another_worker"
    assert tracker.holder("batch_x", 0, 1) is None
    # worker-1's heartbeat ended: worker-2 takes the attempt over.
    assert tracker.on_accepted(accepted("worker-2"), 3.0, "worker-2", lambda worker: False) is None
    assert tracker.holder("batch_x", 0, 0) == "worker-2"


def test_one_result_per_line_is_recorded_and_its_holders_forgotten() -> None:
    tracker, run = run_of()
    tracker.on_accepted(accepted("worker-1"), 1.0, "worker-1")
    assert tracker.judge(run, (W, "worker-2"), result("worker-2"), "worker-1") == "attempt_held_by_another"
    assert tracker.judge(run, (W, "worker-1"), result("worker-1"), "worker-1") == TAKE
    # Being recorded: a second result of the line (it ran twice) is a duplicate.
    assert tracker.judge(run, (W, "worker-1"), result("worker-1"), "worker-1") == DUPLICATE
    tracker.not_recorded(run, 0)  # the record's publish failed: the next result of the line may be taken
    assert tracker.judge(run, (W, "worker-1"), result("worker-1"), "worker-1") == TAKE
    assert tracker.on_result(result("worker-1")) and not run.recording
    assert not tracker.on_result(result("worker-1"))  # the first record per line counts
    # The holder is remembered once the line is done: a late forgery is still refused.
    assert tracker.holder("batch_x", 0, 0) == "worker-1"


def test_a_taken_result_whose_record_never_comes_back_is_taken_again_after_a_lease() -> None:
    """The record of a taken result was acknowledged and then lost (a NATS server killed hard):
    once the line's lease ends, it runs again and its next result is taken, not a duplicate."""
    tracker, run = run_of(total=1)
    [(_, line, attempt, _)] = tracker.take(1, now=0.0)
    tracker.published(run, line, attempt)
    tracker.on_accepted(accepted("worker-1"), 1.0, "worker-1")
    assert tracker.judge(run, (W, "worker-1"), result("worker-1"), "worker-1") == TAKE
    assert tracker.expire_leases(now=tracker.line_lease_s + 1.0) == 1
    [(_, line, attempt, _)] = tracker.take(1, now=tracker.line_lease_s + 1.0)
    assert (line, attempt) == (0, 1)
    tracker.on_accepted(accepted("worker-2", attempt=1), 62.0, "worker-2")
    again = msgspec.structs.replace(result("worker-2"), attempt=1)
    assert tracker.judge(run, (W, "worker-2"), again, tracker.holder("batch_x", 0, 1)) == TAKE


def test_a_result_whose_attempt_has_no_known_holder_waits_for_its_accepted() -> None:
    tracker, run = run_of(total=1)
    early = [(W, "worker-1"), (W, "worker-2")]
    for sender in early:
        assert tracker.judge(run, sender, result(sender[1]), None) == NOT_HELD
    assert tracker.judge(run, (W, "worker-3"), result("worker-3"), None) == NOT_HELD  # past the bound: not kept
    assert tracker.on_accepted(accepted("worker-1"), 1.0, "worker-1") is None
    released = tracker.released(accepted("worker-1"))
    assert [(sender, r.worker_id) for _, sender, r in released] == [((W, "worker-1"), "worker-1"),
                                                                   ((W, "worker-2"), "worker-2")]
    assert [tracker.judge(run, sender, r, tracker.holder("batch_x", 0, 0)) for _, sender, r in released] == [
        TAKE, "attempt_held_by_another"]
    assert not run.waiting and tracker.released(accepted("worker-1")) == []


def test_result_subjects_name_their_sender_and_ids_cannot_be_guessed() -> None:
    subject = subjects.batch_result_subject("batch_x", W, "worker.1")
    assert subject == "inferbus.batchres.batch_x.w.worker%2E1"
    assert subjects.batch_result_sender(subject) == (W, "worker%2E1")
    assert subjects.batch_result_sender("inferbus.batchres.batch_x") is None
    assert subjects.batch_results_kept_filter("batch_x") == "inferbus.batchres.batch_x.o.*"
    one = m.batch_result_publish_id(result(), f"{W}.worker-1", m.new_usage_nonce())
    assert one.startswith("batch_x-0.w.worker-1.") and len(one) == len("batch_x-0.w.worker-1.") + 24
    assert one != m.batch_result_publish_id(result(), f"{W}.worker-1", m.new_usage_nonce())


def test_where_the_accepted_may_have_been_missed_a_result_without_holder_is_judged_by_its_names() -> None:
    assert verdict((W, "worker-1"), result("worker-1"), "batch_x", None, False, blind=True) == TAKE
    assert verdict((W, "worker-2"), result("worker-1"), "batch_x", None, False, blind=True) == "names_another_worker"
    # A known holder still decides.
    held = verdict((W, "worker-2"), result("worker-2"), "batch_x", "worker-1", False, blind=True)
    assert held == "attempt_held_by_another"


def test_lines_out_while_the_service_was_away_are_blind() -> None:
    tracker, run = run_of(total=3)
    tracker.on_result(result(line=0))
    assert tracker.judge(run, (W, "worker-1"), result(line=1), None) == NOT_HELD  # waits for its Accepted
    released = tracker.lost_sight()  # a reconnect: Accepted events may have been lost meanwhile
    assert run.blind == {1, 2} and [(r.line, r.worker_id) for _, _, r in released] == [(1, "worker-1")]
    assert [tracker.judge(run, sender, r, None) for _, sender, r in released] == [TAKE]
    resumed = Tracker(60.0)
    again = ActiveBatch(record=run.record, custom_ids=run.custom_ids, offsets=run.offsets, base_model="m",
                        done={0: True})
    resumed.add(again, resumed=True)  # a start: the lines without a result are in doubt, and blind
    assert again.blind == {1, 2}
