"""Arrival streams for the fast fleet simulator: a trace's rate shape scaled to a peak, over a day.

The Azure traces are one hour at ~5.5 req/s. Compressing time to reach 833 req/s would leave a
30-second trace, so a trace is used for its *shape* instead: arrivals are counted in bins of
`bin_s` (60 s by default: per-second counts at 5 req/s are mostly sampling noise, which scaled
up 150× would be bursts no fleet of independent users produces), and requests are drawn as a
Poisson process whose rate in each bin is the trace's rate there, multiplied so that the busiest
bin of the whole run reaches `peak_rps`. Request lengths are drawn from the mix (by default the
trace's own requests, with `cached_fraction` of each prompt a prefix-cache hit).

Over a duration longer than the trace, `shape` decides what a day is:
- "tile" (default): the trace's hour repeats, times a diurnal envelope (a cosine from `trough`
  of the peak at `trough_hour` to 1 twelve hours later), so each hour keeps the trace's bursts
  and the day has a night.
- "stretch": the trace's rate shape stretched to the whole duration (one trace minute becomes
  duration/trace-length minutes; no envelope).
With a duration up to twice the trace's, "tile" replays the trace's shape without an envelope.

Pure: seeded `random.Random`, a lazy iterator (a day at 833 req/s peak is tens of millions of
requests; none is kept).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tools.capacity.mix import Mix
from tools.capacity.traces import TraceRequest

Arrival = tuple[float, int, int, int]


def parse_duration(text: str) -> float:
    """'24h', '90m', '3600s' or '3600' → seconds."""
    value = text.strip().lower()
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "d": 86400.0}
    try:
        if value and value[-1] in units:
            seconds = float(value[:-1]) * units[value[-1]]
        else:
            seconds = float(value)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (try 24h, 90m, 3600s)") from None
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return seconds


def rate_shape(trace: Sequence[TraceRequest], bin_s: float = 60.0) -> list[float]:
    """Arrivals per second in consecutive bins of the trace (the last, partial bin by its length)."""
    if not trace:
        raise ValueError("empty trace")
    start = trace[0].arrival_s
    span = max(trace[-1].arrival_s - start, bin_s)
    bins = max(1, math.ceil(span / bin_s))
    counts = [0] * bins
    for request in trace:
        counts[min(bins - 1, int((request.arrival_s - start) // bin_s))] += 1
    widths = [bin_s] * bins
    widths[-1] = max(1e-9, span - bin_s * (bins - 1)) if span > bin_s * (bins - 1) else bin_s
    return [c / w for c, w in zip(counts, widths)]


def diurnal(t_s: float, trough: float = 0.35, trough_hour: float = 4.0) -> float:
    """1 at the day's peak (trough_hour + 12 h), `trough` at trough_hour: a cosine in between."""
    phase = 2 * math.pi * ((t_s / 3600.0 - trough_hour) % 24.0) / 24.0
    return trough + (1.0 - trough) * (1.0 - math.cos(phase)) / 2.0


@dataclass
class DayWorkload:
    shape: list[float]  # req/s per bin, from `rate_shape`
    bin_s: float
    duration_s: float
    peak_rps: float
    mix: Mix
    mode: str = "tile"  # tile | stretch
    trough: float = 0.35
    trough_hour: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("tile", "stretch"):
            raise ValueError(f"shape must be 'tile' or 'stretch', got {self.mode!r}")
        if self.peak_rps <= 0 or self.duration_s <= 0 or self.bin_s <= 0:
            raise ValueError("peak_rps, duration and bin must be positive")
        if not 0 < self.trough <= 1:
            raise ValueError("trough must be in (0, 1]")
        if max(self.shape) <= 0:
            raise ValueError("the trace's rate shape is all zero")
        raw = self._raw_rates()
        self._scale = self.peak_rps / max(rate for _, _, rate in raw)
        self._bins = [(a, b, rate * self._scale) for a, b, rate in raw]

    @property
    def trace_span_s(self) -> float:
        return len(self.shape) * self.bin_s

    def _raw_rates(self) -> list[tuple[float, float, float]]:
        """(start, end, unscaled rate) bins covering the duration."""
        out = []
        if self.mode == "stretch":
            width = self.duration_s / len(self.shape)
            for i, rate in enumerate(self.shape):
                out.append((i * width, (i + 1) * width, rate))
            return out
        envelope = self.duration_s > 2 * self.trace_span_s  # a night needs hours; an hour is just the trace
        t, i = 0.0, 0
        while t < self.duration_s:
            end = min(t + self.bin_s, self.duration_s)
            rate = self.shape[i % len(self.shape)]
            if envelope:
                rate *= diurnal((t + end) / 2, self.trough, self.trough_hour)
            out.append((t, end, rate))
            t, i = end, i + 1
        return out

    def rates(self) -> list[tuple[float, float, float]]:
        """(start, end, req/s) of every bin, scaled to the peak."""
        return list(self._bins)

    def expected_requests(self) -> float:
        return sum((b - a) * rate for a, b, rate in self._bins)

    def arrivals(self) -> Iterator[Arrival]:
        rng = random.Random(self.seed)
        expo = rng.expovariate
        sample = self.mix.sample
        for start, end, rate in self._bins:
            if rate <= 0:
                continue
            t = start + expo(rate)
            while t < end:
                request = sample(rng)
                yield t, request.input_tokens, request.output_tokens, request.cached_tokens
                t += expo(rate)


def constant(rate_rps: float, duration_s: float, mix: Mix, seed: int = 0) -> Iterator[Arrival]:
    """Poisson arrivals at a constant rate (speed measurements, sizing)."""
    rng = random.Random(seed)
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        request = mix.sample(rng)
        yield t, request.input_tokens, request.output_tokens, request.cached_tokens
        t += rng.expovariate(rate_rps)
