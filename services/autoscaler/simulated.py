"""The autoscaler's policy as a fleet-simulator controller (`tools.capacity.fleetsim.fast.Controller`).

The simulator calls `decide(signals, fleet)` every `interval_s` of virtual time with its
`FleetSignals`; this turns them into `PoolSignals`, asks the same `AutoscalePolicy` the service
runs, and carries the decision out with the fleet's controls (`start`, `promote`, `drain`,
`stop_warm`). Duck-typed on purpose: nothing here imports the simulator.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from .policy import AutoscalePolicy, Decision, PolicyConfig
from .signals import PoolSignals


def _maybe(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def pool_signals(signals: Any, pool: str, slots_per_replica: int,
                 latency: tuple[float | None, float | None, float | None] | None = None) -> PoolSignals:
    """`FleetSignals` → `PoolSignals` (the simulator has no batch band and no gateway queue).
    `latency`: (p90 TTFT, p90 TPOT, p90 queue wait) over a longer window than the signals'
    own, if the caller keeps one."""
    running, waiting = sum(signals.running), sum(signals.waiting)
    ttft, tpot, wait = latency if latency is not None else (
        _maybe(signals.ttft_p90_s), _maybe(signals.tpot_p90_s), _maybe(signals.queue_wait_p90_s))
    return PoolSignals(
        pool=pool, serving=signals.serving, warm=signals.warm, starting=signals.starting, draining=signals.draining,
        slots=signals.serving * slots_per_replica, arrival_rate=signals.arrival_rps, waiting=waiting, running=running,
        in_flight=running + waiting, queue_wait_s=wait or 0.0,
        kv_usage=signals.kv_use_max, ttft_p90_s=ttft, tpot_p90_s=tpot,
    )


class LatencyWindow:
    """p90s over the last `window_s`, from the simulator's per-call windows: the service's
    percentiles cover `INFERBUS_AUTOSCALER_LATENCY_WINDOW_S` (30 s), while the simulator hands
    over one controller interval (5 s), whose p90 of a few hundred requests jumps on one slow
    prefill. The per-window p90s are combined weighted by their completions (an approximation of
    the p90 over the whole window: the simulator does not keep the raw values)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._rows: deque[tuple[float, int, float | None, float | None, float | None]] = deque()

    def add(self, signals: Any) -> tuple[float | None, float | None, float | None]:
        self._rows.append((signals.t, signals.completed, _maybe(signals.ttft_p90_s), _maybe(signals.tpot_p90_s),
                           _maybe(signals.queue_wait_p90_s)))
        while self._rows and signals.t - self._rows[0][0] >= self.window_s:
            self._rows.popleft()
        out: list[float | None] = []
        for i in (2, 3, 4):
            pairs = [(row[1], value) for row in self._rows if (value := row[i]) is not None and row[1] > 0]
            total = sum(n for n, _ in pairs)
            out.append(sum(n * v for n, v in pairs) / total if total else None)
        return out[0], out[1], out[2]


class PolicyController:
    def __init__(self, config: PolicyConfig | None = None, *, interval_s: float = 5.0, pool: str = "sim",
                 slots_per_replica: int | None = None, latency_window_s: float = 30.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        # As the service (INFERBUS_AUTOSCALER_LATENCY_WINDOW_S); at or below interval_s: the
        # simulator's own window, as is.
        self.latency = LatencyWindow(latency_window_s) if latency_window_s > interval_s else None
        self.pool = pool
        self._now = 0.0
        self.policy = AutoscalePolicy(lambda: self._now, config or PolicyConfig())
        self.slots_per_replica = slots_per_replica or self.policy.config.slots_per_replica
        self.decisions: list[Decision] = []

    def decide(self, signals: Any, fleet: Any) -> None:
        self._now = signals.t
        latency = self.latency.add(signals) if self.latency is not None else None
        decision = self.policy.decide(pool_signals(signals, self.pool, self.slots_per_replica, latency))
        self.decisions.append(decision)
        self.apply(decision, fleet)

    @staticmethod
    def apply(decision: Decision, fleet: Any) -> None:
        """Reach the targets: promote warm replicas first, cold-start the rest; drain surplus
        serving replicas (they finish their work); stop surplus warm ones."""
        nodes = list(fleet.nodes.values())
        starting_to_serve = sum(1 for n in nodes if n.state == "starting" and not n.warm_target)
        starting_to_warm = sum(1 for n in nodes if n.state == "starting" and n.warm_target)
        serving = sum(1 for n in nodes if n.state == "serving") + starting_to_serve
        warm = sum(1 for n in nodes if n.state == "warm")
        if decision.desired_serving > serving:
            gap = decision.desired_serving - serving
            promoted = len(fleet.promote(min(gap, warm)))
            warm -= promoted
            if gap > promoted:
                fleet.start(gap - promoted)
        elif decision.desired_serving < serving:
            fleet.drain(min(serving - decision.desired_serving, serving - starting_to_serve))
        warm_soon = warm + starting_to_warm
        if decision.desired_warm > warm_soon:
            fleet.start(decision.desired_warm - warm_soon, warm=True)
        elif decision.desired_warm < warm_soon and warm:
            fleet.stop_warm(min(warm, warm_soon - decision.desired_warm))
