"""A reactive threshold autoscaler, as KEDA drives the Kubernetes HPA: the baseline that the
SLO-driven policy (`policy.py`) is measured against in the fleet simulator (`bench/autoscale.py`).

What it copies (HPA `autoscaling/v2`, the defaults KEDA leaves in place):

- the metric: requests waiting (queued, not running) per replica, target 5
  (a KEDA Prometheus trigger on `num_requests_waiting` with `threshold: 5`, `AverageValue`);
- the rule: desired = ceil(replicas × metric ÷ target); no change while the ratio is within the
  10 % tolerance. Replicas still starting have no metric yet: on a scale-up they count as 0
  waiting, on a scale-down as exactly at the target (the HPA's conservative treatment of
  not-ready pods);
- the sync period: every 15 s;
- scale-up: no stabilisation window, at most +100 % or +4 replicas (whichever is more) per period;
- scale-down: the highest recommendation of the last 300 s (stabilisation window), then at most
  −100 % per period;
- min / max replicas. Cold starts only: there is no warm pool; removed replicas drain and stop.

Pure: the caller passes the time; `ThresholdController` is the fleet simulator's controller
(duck-typed on `FleetSignals` and `FastFleet`, nothing here imports the simulator).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ThresholdConfig:
    target_waiting: float = 5.0  # waiting requests per replica (KEDA threshold, HPA AverageValue)
    tolerance: float = 0.1  # HPA --horizontal-pod-autoscaler-tolerance
    min_replicas: int = 1
    max_replicas: int = 200
    sync_s: float = 15.0  # HPA sync period
    up_window_s: float = 0.0  # HPA default scaleUp.stabilizationWindowSeconds
    up_percent: float = 1.0  # +100 % per period ...
    up_pods: int = 4  # ... or +4 replicas, whichever is more (selectPolicy Max)
    down_window_s: float = 300.0  # HPA default scaleDown.stabilizationWindowSeconds
    down_percent: float = 1.0  # −100 % per period

    def __post_init__(self) -> None:
        if self.target_waiting <= 0 or self.sync_s <= 0:
            raise ValueError("target_waiting and sync_s must be > 0")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}..{self.max_replicas}")
        if self.tolerance < 0 or self.up_window_s < 0 or self.down_window_s < 0:
            raise ValueError("tolerance and windows must be >= 0")


@dataclass(frozen=True)
class ThresholdDecision:
    at: float
    replicas: int  # current (ready + starting)
    desired: int
    recommendation: int  # before stabilisation and rate limits
    waiting: int
    reason: str


@dataclass
class ThresholdPolicy:
    config: ThresholdConfig = field(default_factory=ThresholdConfig)
    _history: deque[tuple[float, int]] = field(default_factory=deque)
    _seed: tuple[float, int] | None = None

    def decide(self, now: float, ready: int, starting: int, waiting: int) -> ThresholdDecision:
        c = self.config
        current = ready + starting
        if self._seed is None:
            # As if it had run before at the current size: a freshly created HPA would otherwise see
            # an empty window and could drop an existing fleet to the minimum on its first sync.
            self._seed = (now, current)
        if current == 0:
            raw = c.min_replicas
        else:
            up_ratio = waiting / (c.target_waiting * current)  # starting replicas count as 0 waiting
            down_ratio = (waiting + starting * c.target_waiting) / (c.target_waiting * current)
            if up_ratio > 1 + c.tolerance:
                raw = math.ceil(current * up_ratio - 1e-9)
            elif down_ratio < 1 - c.tolerance:
                raw = math.ceil(current * down_ratio - 1e-9)
            else:
                raw = current
        raw = min(c.max_replicas, max(c.min_replicas, raw))
        self._history.append((now, raw))
        horizon = max(c.up_window_s, c.down_window_s)
        while self._history and now - self._history[0][0] > horizon:
            self._history.popleft()
        desired = current
        if raw > current:
            # Scale-up stabilisation: the lowest recommendation of the up window (0 s: this one).
            lowest = min(r for t, r in self._history if now - t <= c.up_window_s)
            limit = max(math.ceil(current * (1 + c.up_percent)), current + c.up_pods)
            desired = min(max(current, lowest), limit)
        elif raw < current:
            # Scale-down stabilisation: the highest recommendation of the down window.
            window = [r for t, r in self._history if now - t <= c.down_window_s]
            if now - self._seed[0] <= c.down_window_s:
                window.append(self._seed[1])
            highest = max(window)
            limit = math.floor(current * (1 - c.down_percent))
            desired = max(min(current, highest), limit, c.min_replicas)
        desired = min(c.max_replicas, max(c.min_replicas, desired))
        per = waiting / current if current else 0.0
        if desired > current:
            reason = (f"scale up {current}→{desired}: {waiting} waiting, {per:.1f} per replica > "
                      f"{c.target_waiting:g} (recommends {raw})")
        elif desired < current:
            reason = (f"scale down {current}→{desired}: {per:.1f} waiting per replica, highest recommendation "
                      f"of the last {c.down_window_s:g} s is {desired}")
        else:
            reason = f"hold {current}: {per:.1f} waiting per replica (target {c.target_waiting:g}, recommends {raw})"
        return ThresholdDecision(at=now, replicas=current, desired=desired, recommendation=raw, waiting=waiting,
                                 reason=reason)


class ThresholdController:
    """`ThresholdPolicy` as a fleet-simulator controller: cold starts up, drains down."""

    def __init__(self, config: ThresholdConfig | None = None) -> None:
        self.policy = ThresholdPolicy(config or ThresholdConfig())
        self.interval_s = self.policy.config.sync_s
        self.decisions: list[ThresholdDecision] = []

    @staticmethod
    def waiting(signals: Any, fleet: Any = None) -> int:
        """Requests queued in serving engines, plus any the router could not place yet (the fleet's
        shared queue). Not the running work of draining replicas: that is not waiting."""
        return sum(signals.waiting) + len(getattr(fleet, "shared", ()))

    def decide(self, signals: Any, fleet: Any) -> None:
        decision = self.policy.decide(signals.t, signals.serving, signals.starting, self.waiting(signals, fleet))
        self.decisions.append(decision)
        if decision.desired > decision.replicas:
            fleet.start(decision.desired - decision.replicas)
        elif decision.desired < decision.replicas:
            fleet.drain(min(decision.replicas - decision.desired, signals.serving))
