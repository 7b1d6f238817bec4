"""The autoscaler against the KEDA-like threshold baseline in the fast fleet simulator (a short
version of `bench/autoscale.py`), and the threshold controller's own rules."""

from __future__ import annotations

import random

import pytest

from services.autoscaler.policy import PolicyConfig
from services.autoscaler.simulated import PolicyController
from services.autoscaler.threshold import ThresholdConfig, ThresholdController, ThresholdPolicy
from tools.capacity.fleetsim.fast import FastConfig, FastFleet

COLD_S, WARM_S = 60.0, 5.0


def ramp(seed: int = 3) -> list[tuple[float, int, int, int]]:
    """4 req/s for 2 min, a linear ramp to 24 req/s over 4 min, 24 req/s for 3 min."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        rate = 4.0 if t < 120 else 4.0 + 20.0 * min(1.0, (t - 120) / 240)
        t += rng.expovariate(rate)
        if t >= 540:
            return out
        out.append((t, 2000, 300, 1000))


class Recorder:
    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.interval_s = inner.interval_s  # type: ignore[attr-defined]
        self.rows: list[tuple[float, int, int, int]] = []  # t, serving, warm, starting

    def decide(self, signals, fleet) -> None:  # type: ignore[no-untyped-def]
        self.rows.append((signals.t, signals.serving, signals.warm, signals.starting))
        self.inner.decide(signals, fleet)  # type: ignore[attr-defined]


def run(controller: object) -> tuple[object, Recorder]:
    recorder = Recorder(controller)
    fleet = FastFleet(FastConfig(replicas=2, cold_start_s=COLD_S, warm_start_s=WARM_S), ramp(), controller=recorder)
    return fleet.run(), recorder


@pytest.mark.slow
def test_autoscaler_scales_ahead_of_a_ramp_and_beats_the_threshold_policy() -> None:
    policy = PolicyController(PolicyConfig(cold_start_s=COLD_S, warm_start_s=WARM_S, max_serving=16, max_replicas=24,
                                           burst_memory_s=3600.0), interval_s=5.0)
    ours, ours_rows = run(policy)
    theirs, _ = run(ThresholdController(ThresholdConfig(max_replicas=24)))
    # Ahead of the ramp: by 4 minutes in (halfway up, 14 req/s), replicas for the top of the ramp
    # (24 × 1.15 / 4.1 → 7) are already serving, warm or starting.
    at_240 = [r for r in ours_rows.rows if r[0] <= 240][-1]
    assert at_240[1] + at_240[2] + at_240[3] >= 7
    assert any(d.direction == "up" and d.at < 200 for d in policy.decisions)
    assert ours.minute_attainment >= 0.9  # type: ignore[attr-defined]
    assert ours.minute_attainment > theirs.minute_attainment  # type: ignore[attr-defined]


# ---- the threshold controller: KEDA / HPA rules ------------------------------------------------


def test_threshold_scales_up_in_proportion_within_the_hpa_rate_limit() -> None:
    policy = ThresholdPolicy(ThresholdConfig(target_waiting=5))
    # 10 replicas, 80 waiting: 8 per replica → ceil(10 × 8/5) = 16 (within +100 %).
    d = policy.decide(0.0, ready=10, starting=0, waiting=80)
    assert (d.recommendation, d.desired) == (16, 16)
    assert "scale up 10→16" in d.reason and "8.0 per replica > 5" in d.reason
    # 2 replicas, 200 waiting: recommends 40, limited to max(2 × 2, 2 + 4) = 6 per period.
    d = ThresholdPolicy().decide(0.0, ready=2, starting=0, waiting=200)
    assert (d.recommendation, d.desired) == (40, 6)


def test_threshold_holds_inside_the_tolerance_and_counts_starting_replicas_as_idle() -> None:
    policy = ThresholdPolicy(ThresholdConfig(target_waiting=5))
    assert policy.decide(0.0, ready=10, starting=0, waiting=54).desired == 10  # 5.4 per replica: within 10 %
    # 10 ready + 10 starting, 120 waiting: 6 per replica over 20 → 24.
    assert policy.decide(15.0, ready=10, starting=10, waiting=120).desired == 24


def test_threshold_scale_down_waits_for_the_stabilisation_window() -> None:
    policy = ThresholdPolicy(ThresholdConfig(target_waiting=5, down_window_s=300, min_replicas=2))
    assert policy.decide(0.0, ready=10, starting=0, waiting=50).desired == 10
    # Nothing waiting: the recommendation is the minimum, but the window remembers 10 (and, at the
    # start, the fleet's own size).
    for t in range(15, 300, 15):
        d = policy.decide(float(t), ready=10, starting=0, waiting=0)
        assert d.recommendation == 2 and d.desired == 10
    d = policy.decide(315.0, ready=10, starting=0, waiting=0)
    assert d.desired == 2 and "scale down 10→2" in d.reason


def test_threshold_bounds() -> None:
    policy = ThresholdPolicy(ThresholdConfig(min_replicas=3, max_replicas=8))
    assert policy.decide(0.0, ready=6, starting=0, waiting=600).desired == 8
    with pytest.raises(ValueError):
        ThresholdConfig(min_replicas=0)


def test_threshold_controller_cold_starts_and_drains() -> None:
    class Signals:
        def __init__(self, t: float, serving: int, waiting: tuple[int, ...]) -> None:
            self.t, self.serving, self.starting, self.waiting = t, serving, 0, waiting

    class Fleet:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []
            self.shared = [object()] * 10  # requests the router could not place count as waiting

        def start(self, n: int, *, warm: bool = False) -> list[str]:
            assert not warm  # no warm pool
            self.calls.append(("start", n))
            return []

        def drain(self, n: int, **_: object) -> list[str]:
            self.calls.append(("drain", n))
            return []

    controller = ThresholdController(ThresholdConfig(down_window_s=30))
    assert controller.interval_s == 15.0
    fleet = Fleet()
    controller.decide(Signals(0.0, 4, (5, 5, 5, 5)), fleet)  # 30 waiting over 4 → ceil(4 × 7.5 / 5) = 6
    assert fleet.calls == [("start", 2)]
    fleet = Fleet()
    fleet.shared = []
    for t in (15.0, 30.0, 45.0):
        controller.decide(Signals(t, 4, (0, 0, 0, 0)), fleet)
    assert fleet.calls == [("drain", 3)]
