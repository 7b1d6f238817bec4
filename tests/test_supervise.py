"""The launcher's restart schedule (pure, fake clock)."""

from __future__ import annotations

from inferbus.runtime.supervise import Backoff


def test_restarts_back_off_exponentially_up_to_the_cap() -> None:
    backoff = Backoff(initial_s=1.0, max_s=8.0, stable_s=60.0)
    now, waits = 0.0, []
    for _ in range(6):
        waits.append(backoff.exited(now))
        assert not backoff.due(now + waits[-1] - 0.01) and backoff.due(now + waits[-1])
        now += waits[-1]
        backoff.restarted(now)
        now += 0.5  # crashes again at once
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_process_that_stayed_up_starts_over_at_the_first_delay() -> None:
    backoff = Backoff(initial_s=1.0, max_s=30.0, stable_s=60.0)
    for now in (0.0, 2.0, 5.0):
        backoff.exited(now)
        backoff.restarted(now + backoff.delay_s)
    assert backoff.delay_s == 4.0
    assert backoff.exited(5.0 + 4.0 + 61.0) == 1.0


def test_asking_again_while_waiting_does_not_push_the_restart_back() -> None:
    backoff = Backoff(initial_s=2.0)
    assert backoff.exited(10.0) == 2.0
    assert backoff.exited(11.0) == 1.0
    assert backoff.due(12.0)
