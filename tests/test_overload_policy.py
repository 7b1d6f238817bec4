import math

import msgspec

from proto import messages as m
from services.gateway.overload import OverloadPolicy, Verdict, poisson_wait_quantile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load(worker: str, *, in_flight: int, completed: int, waiting: int = 0, max_running: int = 10) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker, model="m", ts=0, seq=0, running=in_flight, waiting=waiting,
                        in_flight=in_flight, max_running=max_running, kv_used_tokens=0, kv_capacity_tokens=1,
                        completed=completed)


def busy_fleet(clock: Clock, policy: OverloadPolicy, rate_per_worker: float) -> None:
    for step in range(10):  # ten load reports, 1 s apart, each worker full and finishing steadily
        for worker in ("a", "b"):
            policy.on_load(load(worker, in_flight=10, completed=int(step * rate_per_worker)))
        clock.now += 1.0


def test_idle_capacity_means_no_wait_even_with_a_queue_shorter_than_free_slots() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    policy.on_load(load("a", in_flight=2, completed=0))
    policy.on_queue_depth("standard", 5)
    assert policy.expected_wait_s("standard") == 0.0
    assert policy.admit("standard") == Verdict(True, 0.0, 0.0)


def test_standard_is_shed_before_premium_when_the_queue_outgrows_its_budget() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    busy_fleet(clock, policy, rate_per_worker=2.0)  # fleet finishes ~4 requests/s
    policy.on_queue_depth("premium", 4)
    policy.on_queue_depth("standard", 20)
    # premium waits behind 4 premium requests (~1.25 s); standard behind all 24 (~6 s)
    assert 0.5 < policy.expected_wait_s("premium") < 2.5
    assert policy.expected_wait_s("standard") > 5
    verdict = policy.admit("standard")
    assert not verdict.admitted and verdict.retry_after_s >= 2
    assert policy.admit("premium").admitted


def test_stale_or_draining_workers_do_not_count() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, stale_after_s=3.0)
    busy_fleet(clock, policy, rate_per_worker=2.0)
    policy.on_queue_depth("standard", 50)
    assert not policy.admit("standard").admitted
    clock.now += 10  # reports stopped: the view is stale, which is not overload
    assert policy.admit("standard").admitted


def test_batch_lines_are_room_for_interactive_work() -> None:
    # A worker full of batch lines preempts them for interactive work: not overload.
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    busy_fleet(clock, policy, rate_per_worker=2.0)
    policy.on_queue_depth("standard", 30)
    assert policy.expected_wait_s("standard") > 3
    for step in range(3):
        for worker in ("a", "b"):
            report = load(worker, in_flight=10, completed=20 + step)
            policy.on_load(m.WorkerLoad(**{**{f: getattr(report, f) for f in report.__struct_fields__},
                                           "batch_in_flight": 9}))
        clock.now += 1.0
    policy.on_queue_depth("standard", 10)
    assert policy.free_slots() == 18
    assert policy.admit("standard").admitted


def test_retry_after_is_small_and_bounded_even_when_almost_nothing_finishes() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, max_retry_after_s=30.0)
    for step in range(40):  # one completion in 40 s across a full fleet with a deep queue
        policy.on_load(load("a", in_flight=10, completed=1 if step > 20 else 0))
        clock.now += 1.0
    policy.on_queue_depth("standard", 10_000)
    verdict = policy.admit("standard")
    assert not verdict.admitted and verdict.expected_wait_s > 1000
    assert verdict.retry_after_s == 30.0
    assert verdict.headers() == {"retry-after": "30", "retry-after-ms": "30000"}


def test_a_full_fleet_that_finishes_nothing_is_overloaded_once_full_longer_than_the_budget() -> None:
    # Long answers: every slot busy, work queued, no completion yet. The old estimate said "no
    # data, no wait" and admitted everything; the wait is at least as long as nothing finished.
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    policy.on_queue_depth("standard", 5)
    policy.on_load(load("a", in_flight=10, completed=0))
    assert policy.admit("standard").admitted  # just became full: unknown is not overload
    for _ in range(5):
        clock.now += 1.0
        policy.on_load(load("a", in_flight=10, completed=0))
    verdict = policy.admit("standard")
    assert not verdict.admitted and verdict.expected_wait_s == 5.0
    assert policy.admit("premium").admitted  # premium waits behind no premium work


def test_the_rate_is_measured_over_a_window_not_between_two_reports() -> None:
    # 4 completions a second in bursts every 2 s: report-to-report samples are 0 or 8/s.
    clock = Clock()
    policy = OverloadPolicy(clock=clock, rate_window_s=10.0, min_completions=1, quantile=0.5)
    completed = 0
    for step in range(40):
        if step % 8 == 0:
            completed += 8
        policy.on_load(load("a", in_flight=10, completed=completed, max_running=10))
        clock.now += 0.25
    rate = policy.completion_rate()
    assert rate is not None and 3.0 < rate < 5.0
    policy.on_queue_depth("standard", 11)
    assert 2.0 < policy.expected_wait_s("standard") < 4.0  # 12 ahead of a free slot at ~4/s (median)


def test_a_restarted_worker_does_not_count_negative_completions() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    for step in range(5):
        policy.on_load(load("a", in_flight=10, completed=100 + step))
        clock.now += 1.0
    policy.on_load(load("a", in_flight=10, completed=0))  # counter reset
    assert policy.completion_rate() is None  # unknown again, not negative


def test_idle_time_does_not_dilute_the_rate() -> None:
    # 25 s idle, then full for 5 s finishing 2 a second: the slots free at 2/s, not 10/30 s.
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    for _ in range(25):
        policy.on_load(load("a", in_flight=0, completed=0))
        clock.now += 1.0
    for step in range(6):
        policy.on_load(load("a", in_flight=10, completed=2 * step))
        clock.now += 1.0
    rate = policy.completion_rate()
    assert rate is not None and 1.9 < rate < 2.1


def test_long_answers_and_idle_spells_keep_their_measured_rate() -> None:
    # Answers of 60 s on 10 slots: fewer than a few completions fit in 30 s, and the fleet then
    # idles for two minutes. The window reaches back to the last completions, so the next burst
    # is judged by the rate measured before, not admitted blindly.
    clock = Clock()
    policy = OverloadPolicy(clock=clock, rate_window_s=30.0, min_completions=8, quantile=0.5)
    completed = 0
    for step in range(240):  # 4 minutes full, one completion every 6 s (10 slots / 60 s)
        if step % 6 == 5:
            completed += 1
        policy.on_load(load("a", in_flight=10, completed=completed))
        clock.now += 1.0
    for _ in range(120):
        policy.on_load(load("a", in_flight=0, completed=completed))
        clock.now += 1.0
    rate = policy.completion_rate()
    assert rate is not None and 0.14 < rate < 0.2
    policy.on_load(load("a", in_flight=10, completed=completed))
    policy.on_queue_depth("standard", 3)
    verdict = policy.admit("standard")
    assert not verdict.admitted and 20 < verdict.expected_wait_s < 30  # 4 ahead at ~1/6 s


def test_a_workers_free_slots_are_known_only_from_a_recent_report() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    policy.on_load(load("a", in_flight=10, completed=0))
    policy.on_load(load("b", in_flight=4, completed=0))
    assert policy.worker_free_slots("a") == 0 and policy.worker_free_slots("b") == 6
    assert policy.worker_free_slots("c") is None
    clock.now += 5.0  # a paused worker reports nothing: it may not be trusted to start its queue
    assert policy.worker_free_slots("a", fresh_s=2.0) is None


def test_this_gateways_own_queued_requests_count_before_the_polled_depth_catches_up() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    busy_fleet(clock, policy, rate_per_worker=1.0)  # ~2 a second
    policy.on_queue_depth("standard", 0)  # polled before the burst
    assert policy.admit("standard", queued_here=2).admitted  # 3 ahead of a slot: 1.5 s
    assert not policy.admit("standard", queued_here=8).admitted  # a burst just published: 4.5 s


def test_the_wait_compared_with_the_budget_is_its_90th_percentile() -> None:
    # n-th of Poisson events at rate r: Gamma(n, 1/r). n=1: exponential, p90 = ln(10) / r.
    assert abs(poisson_wait_quantile(1, 2.0, 0.9) - math.log(10) / 2.0) < 1e-6
    assert abs(poisson_wait_quantile(4, 1.0, 0.9) - 6.6808) < 1e-3  # chi-squared(8) 90th percentile / 2
    assert abs(poisson_wait_quantile(100, 1.0, 0.5) - 99.67) < 0.5  # normal region: about the mean
    assert poisson_wait_quantile(0, 1.0, 0.9) == 0.0
    # So a request whose mean wait fits the budget is still shed when its tail does not.
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    busy_fleet(clock, policy, rate_per_worker=1.0)  # ~2 a second
    policy.on_queue_depth("standard", 4)  # 5 to start: mean 2.5 s, 90th percentile ~4.0 s
    verdict = policy.admit("standard")
    assert not verdict.admitted and 3.5 < verdict.expected_wait_s < 4.5


def test_a_placement_on_a_full_worker_with_a_long_own_queue_does_not_fit_while_the_fleet_admits() -> None:
    """The fleet has room (worker b is idle), so the pooled estimate admits; but a request placed
    on worker a's own queue would wait behind a's queue at a's rate, past the budget: that
    placement does not fit (the request goes to the shared queue), one on b does."""
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    for step in range(10):  # a: full, finishing 1 request/s (10 slots, each held ~10 s); b: idle
        policy.on_load(load("a", in_flight=10, completed=step))
        policy.on_load(load("b", in_flight=0, completed=0))
        clock.now += 1.0
    policy.on_queue_depth("standard", 6, by_worker={"a": 6})
    assert policy.admit("standard").admitted  # 6 queued < b's 10 free slots
    wait_a = policy.worker_wait_s("a", "standard")
    assert wait_a is not None and wait_a > 3.0  # 7th start on a: Gamma(7, 1 s) 90% ≈ 10.5 s
    assert not policy.placement_fits("a", "standard")
    assert policy.placement_fits("b", "standard")
    # With a's own queue empty, a request placed there is the next to start on a: ~2.3 s (90%).
    policy.on_queue_depth("standard", 0, by_worker={})
    assert policy.placement_fits("a", "standard")
    # ...unless this gateway has just queued requests there that the polled depth does not show yet.
    assert not policy.placement_fits("a", "standard", queued_here=2)


def test_a_placed_request_waits_only_behind_its_own_and_more_important_bands_on_that_worker() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    for step in range(10):
        policy.on_load(load("a", in_flight=10, completed=2 * step))  # 2 completions/s
        clock.now += 1.0
    policy.on_queue_depth("standard", 30, by_worker={"a": 30})
    policy.on_queue_depth("premium", 2, by_worker={"a": 2})
    assert policy.placement_fits("a", "premium")  # behind 2 premium: Gamma(3, 0.5 s) 90% ≈ 2.7 s
    assert not policy.placement_fits("a", "standard")


def test_a_worker_without_reports_or_with_unknown_rate() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    assert policy.worker_wait_s("nobody", "standard") is None
    assert policy.placement_fits("nobody", "standard")  # no data is the router's call, not overload
    policy.on_load(load("a", in_flight=10, completed=0))  # full, never finished anything yet
    clock.now += 1.0
    policy.on_load(load("a", in_flight=10, completed=0))
    policy.on_queue_depth("standard", 1, by_worker={"a": 1})
    assert policy.placement_fits("a", "standard")  # stalled 1 s: a lower bound within the budget
    clock.now += 5.0
    policy.on_load(load("a", in_flight=10, completed=0))
    assert not policy.placement_fits("a", "standard")  # no progress for 6 s > 3 s
    policy.on_load(msgspec.structs.replace(load("a", in_flight=10, completed=0), draining=True))
    assert policy.worker_wait_s("a", "standard") is None  # draining: not a placement target


def test_free_slots_that_do_not_start_work_are_shed_on_the_measured_start_lag() -> None:
    # The reported case: workers report idle slots (the model sees no wait), yet the requests
    # admitted before took 40 s to their first token and others still wait for theirs.
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    policy.on_load(load("a", in_flight=4, completed=0))  # six of ten slots reported free
    assert policy.expected_wait_s("standard") == 0.0
    for seconds in (30.0, 35.0, 40.0):
        policy.on_started("standard", seconds)
    verdict = policy.admit("standard", unstarted_ages=[12.0, 20.0, 25.0])
    assert not verdict.admitted and verdict.expected_wait_s >= 25.0
    assert verdict.retry_after_s == 30.0  # capped
    # Premium waits behind premium work only, which starts in time.
    for _ in range(5):
        policy.on_started("premium", 0.2)
    assert policy.admit("premium").admitted


def test_the_start_lag_is_the_quantile_of_recent_starts_and_waiting_ages() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, quantile=0.9, start_window_s=10.0, min_starts=5)
    for seconds in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        policy.on_started("standard", seconds)
    assert policy.start_lag_s("standard") == 0.8  # the 90th of eight samples: the eighth
    assert policy.start_lag_s("standard", unstarted_ages=[5.0, 6.0]) == 5.0  # ten samples: the ninth
    assert policy.admit("standard", unstarted_ages=[1.0]).admitted
    clock.now += 10.5  # the starts aged out of the window; a few waiting requests alone say nothing yet
    assert policy.start_lag_s("standard", unstarted_ages=[9.0, 9.0]) == 0.0
    assert policy.start_lag_s("standard", unstarted_ages=[9.0] * 5) == 9.0


def test_the_start_lag_can_be_turned_off() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock, start_window_s=0.0)
    for _ in range(10):
        policy.on_started("standard", 60.0)
    assert policy.start_lag_s("standard", unstarted_ages=[60.0] * 10) == 0.0
    assert policy.admit("standard", unstarted_ages=[60.0] * 10).admitted


def test_a_request_that_waited_past_the_budget_for_a_worker_sheds_the_next() -> None:
    # The head of the line has waited 4 s for a worker: a new request joins the same line.
    clock = Clock()
    policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": 3.0})
    policy.on_load(load("a", in_flight=4, completed=0))  # reported free slots: the model sees no wait
    assert policy.admit("standard", oldest_waiting_s=2.5).admitted
    verdict = policy.admit("standard", oldest_waiting_s=4.0)
    assert not verdict.admitted and verdict.expected_wait_s == 4.0 and verdict.retry_after_s == 1.0
    assert policy.admit("premium", oldest_waiting_s=4.0).admitted  # within premium's 10 s
    off = OverloadPolicy(clock=clock, start_window_s=0.0)
    assert off.admit("standard", oldest_waiting_s=60.0).admitted


def test_only_slots_of_workers_that_pull_the_band_count() -> None:
    clock = Clock()
    policy = OverloadPolicy(clock=clock)
    busy_fleet(clock, policy, rate_per_worker=2.0)
    premium_only = msgspec.structs.replace(load("c", in_flight=0, completed=0), bands=["premium"])
    policy.on_load(premium_only)  # ten idle slots, for premium requests only
    policy.on_queue_depth("standard", 8)
    assert policy.expected_wait_s("premium") == 0.0
    assert policy.expected_wait_s("standard") > 0.0  # eight ahead, no slot of its own free
    older = load("d", in_flight=0, completed=0)  # a worker that does not say pulls every band
    policy.on_load(older)
    assert policy.expected_wait_s("standard") == 0.0
