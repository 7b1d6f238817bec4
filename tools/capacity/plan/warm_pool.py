"""The warm pool: replicas kept loaded (or asleep, waking in seconds) to cover a cold start.

A new 70B FP8 replica takes minutes to serve (weights load, graph capture). While it boots the
load keeps rising, so the autoscaler needs ready capacity for the rise over that lead time:

    warm replicas = ⌈ramp (req/s per s) × cold-start lead time (s) ÷ per-replica goodput⌉

Warm replicas themselves take `warm_start_s` to wake; the rise over that short wait must fit in
the fleet's headroom (replicas × goodput − planned rate), which the plan checks.

The ramp is either given (req/s per minute) or read from a trace: arrivals binned per whole
minute, the per-minute rate multiplied so that the trace's peak minute equals the planned rate
(the clock is kept: compressing time instead would turn an hour of trace into seconds at an 833
req/s peak), and the steepest rise within any window as long as the cold start taken as the
ramp (rise ÷ window). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MINUTE_S = 60.0


@dataclass(frozen=True)
class TraceRamp:
    minutes: int  # whole minutes of trace used
    trace_peak_rps: float  # busiest minute of the trace as recorded
    scale: float  # planned rate ÷ trace peak: how much each minute's rate is multiplied
    window_s: float  # the cold-start window the rise is measured over
    rise_rps: float  # steepest scaled rise within one window
    from_minute: int
    to_minute: int

    @property
    def ramp_rps_per_s(self) -> float:
        return self.rise_rps / self.window_s


@dataclass(frozen=True)
class Ramp:
    rps_per_s: float
    source: str  # "given" or the trace's path
    trace: TraceRamp | None = None


def ramp_from_arrivals(arrivals_s: Sequence[float], planned_rps: float, window_s: float) -> TraceRamp:
    """The steepest rise of the per-minute arrival rate within one `window_s`, scaled to `planned_rps`."""
    if not arrivals_s:
        raise ValueError("the ramp trace has no requests")
    if window_s <= 0 or planned_rps <= 0:
        raise ValueError("the cold-start window and the planned rate must be positive")
    start = min(arrivals_s)
    minutes = int((max(arrivals_s) - start) // MINUTE_S)  # whole minutes only: a partial last one looks like a fall
    if minutes < 2:
        raise ValueError("the ramp trace must span at least two whole minutes")
    counts = [0] * minutes
    for t in arrivals_s:
        i = int((t - start) // MINUTE_S)
        if i < minutes:
            counts[i] += 1
    rates = [c / MINUTE_S for c in counts]
    peak = max(rates)
    if peak <= 0:
        raise ValueError("the ramp trace has no arrivals in its whole minutes")
    scale = planned_rps / peak
    # Windows shorter than a minute: the rise over one minute, pro rata.
    span = max(1, int(window_s // MINUTE_S))
    fraction = min(1.0, window_s / MINUTE_S)
    best, at = 0.0, (0, 0)
    for i in range(minutes):
        for d in range(1, span + 1):
            if i + d < minutes and rates[i + d] - rates[i] > best:
                best, at = rates[i + d] - rates[i], (i, i + d)
    return TraceRamp(minutes, peak, scale, window_s, best * scale * fraction, at[0], at[1])


@dataclass(frozen=True)
class WarmPool:
    ramp_rps_per_s: float
    cold_start_s: float
    warm_start_s: float
    rise_rps: float  # the rate added during one cold start
    replicas: int
    gpus: int
    warm_start_rise_rps: float  # the rate added while warm replicas wake
    headroom_rps: float  # replicas × goodput − planned rate
    covered_by_headroom: bool


def warm_pool(
    *,
    ramp_rps_per_s: float,
    cold_start_s: float,
    warm_start_s: float,
    replica_rps: float,
    tp: int,
    replicas: int,
    rate_rps: float,
) -> WarmPool:
    rise = ramp_rps_per_s * cold_start_s
    warm = math.ceil(rise / replica_rps - 1e-9) if rise > 0 else 0
    wake_rise = ramp_rps_per_s * warm_start_s
    headroom = replicas * replica_rps - rate_rps
    return WarmPool(ramp_rps_per_s, cold_start_s, warm_start_s, rise, warm, warm * tp, wake_rise, headroom,
                    wake_rise <= headroom)
