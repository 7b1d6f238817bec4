"""The worker's batch preemption policy (pure) and how batch pulls draw on the slot budget."""

from __future__ import annotations

import time

import pytest

from inferbus.runtime.settings import load
from proto import bands
from proto import messages as m
from services.worker.attempt import Attempt, line_outcome
from services.worker.preemption import PreemptionConfig, PreemptionPolicy, RunningLine
from services.worker.settings import WorkerSettings
from services.worker.slots import SlotBudget


def run(request_id: str, context: int, started: float = 0.0, generated: int = 0) -> RunningLine:
    return RunningLine(request_id=request_id, context_tokens=context, generated=generated, started=started)


def test_batch_takes_at_most_its_share_and_never_the_headroom() -> None:
    policy = PreemptionPolicy(PreemptionConfig(batch_share=0.75, headroom=1, max_prefilling=64))
    assert policy.batch_room(8, interactive_running=0, batch_running=0) == 6
    assert policy.batch_room(8, interactive_running=0, batch_running=4) == 2
    assert policy.batch_room(8, interactive_running=0, batch_running=6) == 0
    # Interactive work shrinks what batch may take: the last free slot stays interactive's.
    assert policy.batch_room(8, interactive_running=3, batch_running=3) == 1
    assert policy.batch_room(8, interactive_running=4, batch_running=3) == 0
    assert policy.batch_room(8, interactive_running=8, batch_running=0) == 0


def test_small_workers_keep_their_headroom() -> None:
    policy = PreemptionPolicy(PreemptionConfig(batch_share=0.75, headroom=1))
    assert [policy.batch_slots(c) for c in (1, 2, 3, 4, 64)] == [0, 1, 2, 3, 48]
    assert policy.batch_room(1, 0, 0) == 0  # a one-slot worker never runs batch
    wide_open = PreemptionPolicy(PreemptionConfig(batch_share=1.0, headroom=0, max_prefilling=64))
    assert wide_open.batch_room(4, 0, 0) == 4
    assert PreemptionPolicy(PreemptionConfig(batch_share=0.0)).batch_room(64, 0, 0) == 0


def test_no_victims_while_free_slots_cover_the_waiting_work() -> None:
    policy = PreemptionPolicy(PreemptionConfig(headroom=1))
    batch = [run("a", 100), run("b", 200)]
    assert policy.victims(4, interactive_running=0, interactive_waiting=0, batch=batch) == []
    assert policy.victims(4, interactive_running=1, interactive_waiting=1, batch=batch) == []  # one slot free
    assert policy.victims(4, interactive_running=2, interactive_waiting=0, batch=batch) == []


def test_victims_are_the_cheapest_to_resume_and_only_as_many_as_needed() -> None:
    policy = PreemptionPolicy(PreemptionConfig(headroom=1))
    batch = [run("long", 5000), run("short", 120), run("mid", 900)]
    # Full worker (1 interactive + 3 batch), one interactive request waiting: one line goes.
    assert policy.victims(4, interactive_running=1, interactive_waiting=1, batch=batch) == ["short"]
    assert policy.victims(4, interactive_running=1, interactive_waiting=2, batch=batch) == ["short", "mid"]
    # More waiting than there are batch lines: all of them, and no more.
    assert policy.victims(4, interactive_running=1, interactive_waiting=9, batch=batch) == ["short", "mid", "long"]
    # A free slot serves one of the waiting requests by itself.
    assert policy.victims(5, interactive_running=1, interactive_waiting=2, batch=batch) == ["short"]


def test_equal_cost_prefers_the_line_that_started_last() -> None:
    policy = PreemptionPolicy()
    batch = [run("old", 300, started=10.0), run("new", 300, started=20.0)]
    assert policy.victims(2, interactive_running=0, interactive_waiting=1, batch=batch) == ["new"]


def test_without_engine_priority_interactive_waiting_inside_the_engine_needs_a_line_each() -> None:
    policy = PreemptionPolicy(engine_priority=False)
    batch = [run("a", 10), run("b", 20), run("c", 30)]
    # Free worker slots do not help a request the engine keeps waiting: memory does.
    assert policy.victims(8, interactive_running=2, interactive_waiting=0, batch=batch, engine_waiting=2) == ["a", "b"]
    assert policy.victims(8, interactive_running=2, interactive_waiting=0, batch=[], engine_waiting=2) == []


def test_with_engine_priority_the_engine_makes_room_inside_it_and_the_worker_only_for_the_bus() -> None:
    policy = PreemptionPolicy()  # engine priority: the default, as the simulated engine runs
    batch = [run("a", 10), run("b", 20), run("c", 30)]
    assert policy.victims(8, interactive_running=2, interactive_waiting=0, batch=batch, engine_waiting=2) == []
    # Work queued on the bus for a full worker is still the worker's to make room for.
    assert policy.victims(5, interactive_running=2, interactive_waiting=1, batch=batch, engine_waiting=2) == ["a"]


def test_one_batch_line_in_prefill_at_a_time() -> None:
    policy = PreemptionPolicy()  # max_prefilling 1
    assert policy.batch_room(256, 40, 0) == 1
    # A line (or a reserved pull) without its first token yet: no more until it has one.
    assert policy.batch_room(256, 40, 1, batch_prefilling=1) == 0
    assert policy.batch_room(256, 40, 1, batch_prefilling=0) == 1
    assert PreemptionPolicy(PreemptionConfig(max_prefilling=3)).batch_room(256, 40, 1, batch_prefilling=1) == 2


def test_without_engine_priority_no_batch_pulls_while_interactive_work_is_stalled_in_the_engine() -> None:
    policy = PreemptionPolicy(engine_priority=False)
    assert policy.batch_room(256, 40, 2, interactive_stalled=1) == 0
    assert policy.batch_room(256, 40, 2, interactive_stalled=0) == 1
    # With engine priority a new line waits in the engine behind the stalled interactive work.
    assert PreemptionPolicy().batch_room(256, 40, 2, interactive_stalled=1) == 1


def test_batch_lines_per_worker_stop_at_the_step_time_cap() -> None:
    policy = PreemptionPolicy(PreemptionConfig(max_slowdown=0.1, step_seqs=100.0, max_prefilling=64))
    # 10% of (100 + interactive running) sequences.
    assert policy.step_cap(0) == 10 and policy.step_cap(50) == 15
    assert policy.batch_room(256, 50, 0) == 15
    assert policy.batch_room(256, 50, 14) == 1
    assert policy.batch_room(256, 50, 15) == 0
    # The shipped cap: ~6% of 113 + interactive running (H100 TP2).
    assert PreemptionPolicy().step_cap(0) == 6 and PreemptionPolicy().step_cap(100) == 12


def test_bad_configurations_are_refused() -> None:
    for bad in ({"batch_share": 1.5}, {"batch_share": -0.1}, {"headroom": -1}, {"engine_wait_s": -1.0},
                {"max_attempts": 0}, {"max_prefilling": 0}, {"max_slowdown": -0.1}, {"step_seqs": 0.0}):
        with pytest.raises(ValueError):
            PreemptionConfig(**bad)  # type: ignore[arg-type]


def test_worker_settings_carry_the_batch_band_and_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load(WorkerSettings)
    assert settings.band_list() == ["premium", "standard", "batch"]
    assert settings.preemption() == PreemptionConfig()
    monkeypatch.setenv("INFERBUS_WORKER_BATCH_SHARE", "0.5")
    monkeypatch.setenv("INFERBUS_WORKER_BATCH_HEADROOM", "2")
    monkeypatch.setenv("INFERBUS_WORKER_BATCH_MAX_PREFILLING", "2")
    monkeypatch.setenv("INFERBUS_WORKER_BATCH_MAX_SLOWDOWN", "0.05")
    assert load(WorkerSettings).preemption() == PreemptionConfig(batch_share=0.5, headroom=2, max_prefilling=2,
                                                                 max_slowdown=0.05)
    monkeypatch.setenv("INFERBUS_WORKER_BATCH_SHARE", "2")
    with pytest.raises(SystemExit, match="INFERBUS_WORKER_BATCH"):
        load(WorkerSettings)


def test_batch_pulls_reserve_only_the_room_the_policy_grants() -> None:
    """The worker's pull loop in miniature: five consumers (premium and standard, own and shared,
    and the shared batch one) on a four-slot budget; batch asks for `batch_room` each time."""
    policy = PreemptionPolicy(PreemptionConfig(batch_share=0.75, headroom=1))
    budget = SlotBudget(capacity=4, pullers=5)
    batch_running, interactive_running = 0, 0
    for _ in range(10):  # batch keeps asking; each grant becomes a running line
        room = policy.batch_room(budget.capacity, interactive_running, batch_running)
        granted = budget.reserve(room) if room > 0 else 0
        batch_running += granted
    assert batch_running == 3 and budget.free == 1
    # The headroom slot goes to an interactive arrival.
    assert budget.reserve(budget.capacity) == 1
    interactive_running += 1
    assert policy.batch_room(budget.capacity, interactive_running, batch_running) == 0
    # A second interactive request waits: one batch line gives way and its slot is interactive's.
    batch = [run(f"line-{i}", 100 * (i + 1)) for i in range(batch_running)]
    assert policy.victims(budget.capacity, interactive_running, 1, batch) == ["line-0"]
    budget.release(1)
    batch_running -= 1
    assert policy.batch_room(budget.capacity, interactive_running, batch_running) == 0
    assert budget.reserve(budget.capacity) == 1


# ---- how a batch line's attempt ends (the worker's decision, no I/O) --------------------------

class _Worker:
    """How the worker decides a batch line's attempt (its settings' defaults, the wall clock)."""

    def _batch_outcome(self, entry: Attempt, finish: str | None, failure: tuple[str, str, int] | None):  # noqa: ANN202
        return line_outcome(entry, finish, failure, now=time.time(), worker_id="w1",
                            max_attempts=WorkerSettings(worker_id="w1").preemption().max_attempts)


def _worker() -> _Worker:
    return _Worker()


def _line(
    attempt: int = 0, resumed_text: str = "", resumed_tokens: int = 0, deadline: float = 1e12
) -> m.InferenceRequest:
    return m.InferenceRequest(
        request_id=m.batch_request_id("batch_x", 7), tenant="t", model="m", prompt="P",
        sampling=m.SamplingParams(max_new_tokens=100), reply_to="r", deadline=deadline, created=0.0,
        band="batch", priority=bands.ENGINE_PRIORITY["batch"], attempt=attempt, resumed_text=resumed_text,
        resumed_tokens=resumed_tokens, prompt_tokens=12, batch_id="batch_x", batch_line=7,
    )


def _ran(request: m.InferenceRequest, text: list[str], completion: int) -> Attempt:
    return Attempt(request=request, prefilled=True, text_parts=text, completion=completion, prompt_tokens=12)


def test_a_preempted_line_is_requeued_with_its_progress_and_reports_nothing() -> None:
    entry = _ran(_line(attempt=1, resumed_text="abc", resumed_tokens=3), ["de", "f"], completion=6)
    entry.requeue = "preempted"
    status, result, follow_up = _worker()._batch_outcome(entry, "abort", None)
    assert status == "requeued" and result is None and follow_up is not None
    assert (follow_up.attempt, follow_up.resumed_text, follow_up.resumed_tokens) == (2, "abcdef", 6)
    assert follow_up.prompt_tokens == 12 and follow_up.priority == bands.ENGINE_PRIORITY["batch"]
    assert follow_up.request_id == entry.request.request_id and follow_up.batch_line == 7


def test_a_finished_line_reports_its_whole_text_and_totals() -> None:
    entry = _ran(_line(attempt=2, resumed_text="abc", resumed_tokens=3), ["def"], completion=100)
    status, result, follow_up = _worker()._batch_outcome(entry, "length", None)
    assert status == "completed" and follow_up is None and result is not None
    assert result.ok and result.text == "abcdef" and result.finish_reason == "length" and result.attempt == 2
    assert result.usage == m.Usage(prompt_tokens=12, completion_tokens=100)
    assert (result.batch_id, result.line, result.worker_id) == ("batch_x", 7, "w1")


def test_retryable_failures_requeue_until_the_attempts_run_out() -> None:
    worker = _worker()
    status, _, follow_up = worker._batch_outcome(_ran(_line(attempt=3), ["x"], 1), None, None)
    assert status == "requeued" and follow_up is not None and follow_up.attempt == 4
    status, result, follow_up = worker._batch_outcome(_ran(_line(attempt=4), ["x"], 1), None, None)
    assert status == "failed" and follow_up is None and result is not None
    assert not result.ok and result.error_code == "engine_error" and result.status == 502
    # Preemption is not the line's fault: it is requeued whatever its attempt.
    entry = _ran(_line(attempt=9), ["x"], 1)
    entry.requeue = "drain"
    assert worker._batch_outcome(entry, "abort", None)[0] == "requeued"


def test_a_non_retryable_failure_ends_the_line_with_its_error() -> None:
    status, result, _ = _worker()._batch_outcome(_ran(_line(), [], 0), None, ("invalid_request", "too long", 400))
    assert status == "failed" and result is not None and not result.ok
    assert (result.error_code, result.error_message, result.status) == ("invalid_request", "too long", 400)


def test_cancelled_and_expired_lines_bill_what_they_made() -> None:
    worker = _worker()
    entry = _ran(_line(resumed_text="ab", resumed_tokens=2), ["c"], completion=3)
    entry.cancelled, entry.cancel_reason = True, "admin"
    status, result, _ = worker._batch_outcome(entry, "abort", None)
    assert status == "cancelled" and result is not None and result.error_code == "batch_cancelled"
    assert result.usage == m.Usage(prompt_tokens=12, completion_tokens=3)
    entry.cancel_reason = "deadline"
    assert worker._batch_outcome(entry, "abort", None)[1].error_code == "batch_expired"  # type: ignore[union-attr]
    # Past its deadline before any worker ran it: expired, nothing billed.
    late = Attempt(request=_line(deadline=1.0))
    status, result, follow_up = worker._batch_outcome(late, None, None)
    assert status == "failed" and follow_up is None and result is not None
    assert result.error_code == "batch_expired" and result.usage == m.Usage(prompt_tokens=0, completion_tokens=0)


def test_engine_priority_is_read_from_the_engine_unless_the_setting_says(monkeypatch: pytest.MonkeyPatch) -> None:
    with_priority, without = {"enable_priority_scheduling": True}, {"max_running_requests": 256}
    settings = load(WorkerSettings)
    assert settings.engine_has_priority(with_priority) and not settings.engine_has_priority(without)
    monkeypatch.setenv("INFERBUS_WORKER_ENGINE_PRIORITY", "off")
    assert not load(WorkerSettings).engine_has_priority(with_priority)
    monkeypatch.setenv("INFERBUS_WORKER_ENGINE_PRIORITY", "on")
    assert load(WorkerSettings).engine_has_priority(without)
    monkeypatch.setenv("INFERBUS_WORKER_ENGINE_PRIORITY", "sometimes")
    with pytest.raises(SystemExit, match="INFERBUS_WORKER_ENGINE_PRIORITY"):
        load(WorkerSettings)


# ---- the verdict alone (the simulator asks it too) and the load tick --------------------------

def test_attempt_verdict_without_a_worker_record() -> None:
    from services.worker.attempt import CANCELLED, EXPIRED, attempt_verdict

    common = dict(deadline=100.0, attempt=0, max_attempts=3)
    assert attempt_verdict(now=1.0, finish="stop", **common).status == "completed"  # type: ignore[arg-type]
    assert attempt_verdict(now=1.0, finish=None, give_way="preempted", **common).requeue == "preempted"  # type: ignore[arg-type]
    assert attempt_verdict(now=1.0, finish=None, handed_off=True, **common).requeue == "drain"  # type: ignore[arg-type]
    assert attempt_verdict(now=1.0, finish="abort", **common).requeue == "engine_error"  # type: ignore[arg-type]
    assert attempt_verdict(now=1.0, finish=None, deadline=100.0, attempt=2, max_attempts=3).failure[0] == "engine_error"  # type: ignore[index]
    assert attempt_verdict(now=100.0, finish=None, give_way="preempted", **common).failure == EXPIRED  # type: ignore[arg-type]
    assert attempt_verdict(now=1.0, finish="stop", cancelled=True, **common).failure == CANCELLED  # type: ignore[arg-type]
    assert attempt_verdict(now=1.0, finish=None, cancelled=True, cancel_reason="deadline", **common).failure == EXPIRED  # type: ignore[arg-type]


def test_the_load_tick_asks_the_bus_only_when_short_of_slots() -> None:
    from services.worker.preemption import Check, WorkerState

    policy = PreemptionPolicy(PreemptionConfig(headroom=1))
    lines = [run("cheap", 100), run("dear", 900)]
    roomy = WorkerState(capacity=8, interactive=2, interactive_stalled=0, batch=lines)
    assert not policy.asks_bus(roomy) and policy.check(roomy, bus_waiting=5) == Check()
    # Slots reserved by batch pulls on their way are not interactive's to count on.
    tight = WorkerState(capacity=8, interactive=2, interactive_stalled=0, batch=lines, reserved=4)
    assert policy.asks_bus(tight)
    check = policy.check(tight, bus_waiting=1)
    assert check.interactive_waiting == 1 and check.victims == ["cheap"]
    assert policy.pull_room(8, 2, 2, batch_prefilling=0, reserved=0, last=check) == 0  # blocked until the next tick
    assert policy.check(WorkerState(capacity=8, interactive=2, interactive_stalled=0, batch=lines, reserved=4,
                                    draining=True), bus_waiting=1) == Check()


def test_interactive_stalled_in_the_engine_blocks_pulls_without_engine_priority() -> None:
    from services.worker.preemption import WorkerState

    policy = PreemptionPolicy(PreemptionConfig(engine_wait_s=0.5), engine_priority=False)
    assert policy.stalled(10.0, engine_waiting=1, unstarted_since=[9.0, 8.0, 9.9]) == 1
    assert policy.stalled(10.0, engine_waiting=5, unstarted_since=[9.0, 8.0, 9.9]) == 2
    # With no batch line running there is nothing to preempt, and still no pulls while it lasts.
    check = policy.check(WorkerState(capacity=8, interactive=3, interactive_stalled=2, batch=[]))
    assert check.victims == [] and check.interactive_stalled == 2
    assert policy.pull_room(8, 3, 0, batch_prefilling=0, reserved=0, last=check) == 0
    check = policy.check(
        WorkerState(capacity=8, interactive=3, interactive_stalled=1, batch=[run("a", 10), run("b", 5)])
    )
    assert check.victims == ["b"]
