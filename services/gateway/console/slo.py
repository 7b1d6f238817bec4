"""SLO attainment from the gateways' own Prometheus metrics: pure, no I/O, no clock.

The numbers are those Prometheus scrapes from every gateway and the dashboards and alerts read
(deploy/grafana, deploy/prometheus/rules.yml): `inferbus_ttft_seconds` and
`inferbus_tpot_seconds` (histograms), `inferbus_requests_total{status}` and
`inferbus_shed_total`. Each gateway adds what its own counters gained to per-minute totals in
Redis (`recorder.SloRecorder`), so the sum over gateways is the platform's, as `sum(rate(...))`
over the gateways is in PromQL; a p90 is read from the summed buckets with the interpolation of
PromQL's `histogram_quantile`, so the console and a Grafana panel over the same minutes agree.

SLOs (docs/overload-policy.md, DESIGN): p90 TTFT below its budget, p90 TPOT below its budget,
5xx share below its budget. A period *meets* them when all three hold over its requests; the
day's attainment is the share of its periods with traffic that met them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LATENCY_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0)
TPOT_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.25, 0.5)


@dataclass(frozen=True)
class Budgets:
    ttft_p90_s: float = 0.8
    tpot_p90_s: float = 0.04
    error_share: float = 0.001  # 5xx over all requests


@dataclass
class Counts:
    """Requests, 5xx, shed and the two histograms' per-bucket counts (the last bucket is +Inf)."""

    requests: int = 0
    errors: int = 0
    shed: int = 0
    ttft: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    tpot: list[int] = field(default_factory=lambda: [0] * (len(TPOT_BOUNDS) + 1))

    def add(self, other: Counts) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.shed += other.shed
        self.ttft = [a + b for a, b in zip(self.ttft, other.ttft)]
        self.tpot = [a + b for a, b in zip(self.tpot, other.tpot)]

    def empty(self) -> bool:
        return not (self.requests or self.errors or self.shed or any(self.ttft) or any(self.tpot))

    def fields(self) -> dict[str, int]:
        """As a Redis hash's increments (zero fields left out)."""
        found = {"n": self.requests, "e": self.errors, "s": self.shed}
        found.update({f"t{i}": c for i, c in enumerate(self.ttft)})
        found.update({f"p{i}": c for i, c in enumerate(self.tpot)})
        return {k: v for k, v in found.items() if v}

    @classmethod
    def from_fields(cls, raw: Mapping[Any, Any]) -> Counts:
        values = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
        counts = cls(requests=values.get("n", 0), errors=values.get("e", 0), shed=values.get("s", 0))
        counts.ttft = [values.get(f"t{i}", 0) for i in range(len(counts.ttft))]
        counts.tpot = [values.get(f"p{i}", 0) for i in range(len(counts.tpot))]
        return counts


def _per_bucket(cumulative: Mapping[float, float], bounds: Sequence[float]) -> list[int]:
    """Prometheus' cumulative `le` counts as one count per bucket (the last one +Inf)."""
    out, below = [], 0.0
    for bound in [*bounds, math.inf]:
        upto = cumulative.get(bound, below)
        out.append(int(round(upto - below)))
        below = upto
    return out


def from_samples(ttft: Iterable[tuple[str, Mapping[str, str], float]],
                 tpot: Iterable[tuple[str, Mapping[str, str], float]],
                 requests: Iterable[tuple[str, Mapping[str, str], float]],
                 shed: Iterable[tuple[str, Mapping[str, str], float]]) -> Counts:
    """Cumulative counts from the samples (name, labels, value) of the four metric families, every
    label set summed (models, adapters, bands, endpoints)."""

    def buckets(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> dict[float, float]:
        found: dict[float, float] = {}
        for name, labels, value in samples:
            if name.endswith("_bucket"):
                bound = float(labels["le"])
                found[bound] = found.get(bound, 0.0) + value
        return found

    counts = Counts(ttft=_per_bucket(buckets(ttft), LATENCY_BOUNDS), tpot=_per_bucket(buckets(tpot), TPOT_BOUNDS))
    for name, labels, value in requests:
        if name.endswith("_total"):
            counts.requests += int(value)
            if labels.get("status", "").startswith("5"):
                counts.errors += int(value)
    counts.shed = int(sum(value for name, _, value in shed if name.endswith("_total")))
    return counts


def delta(now: Counts, before: Counts) -> Counts:
    """What the counters gained since `before`; a counter that went down was reset (a new
    process), and all of its value is new."""

    def gain(a: int, b: int) -> int:
        return a - b if a >= b else a

    return Counts(requests=gain(now.requests, before.requests), errors=gain(now.errors, before.errors),
                  shed=gain(now.shed, before.shed),
                  ttft=[gain(a, b) for a, b in zip(now.ttft, before.ttft)],
                  tpot=[gain(a, b) for a, b in zip(now.tpot, before.tpot)])


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """PromQL's `histogram_quantile` over one histogram's per-bucket counts: linear inside the
    bucket holding rank q·n (from 0 for the first bucket); the highest finite bound if that is the
    +Inf bucket; None without samples."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0.0
    for i, count in enumerate(counts):
        if seen + count >= rank and count > 0:
            if i >= len(bounds):
                return bounds[-1]
            low = 0.0 if i == 0 else bounds[i - 1]
            return low + (bounds[i] - low) * (rank - seen) / count
        seen += count
    return bounds[-1]


def share_within(bounds: Sequence[float], counts: Sequence[int], budget: float) -> float | None:
    """Share of samples at or below `budget` (exact when it is a bucket bound, as 0.8 s and 40 ms are)."""
    total = sum(counts)
    if total == 0:
        return None
    within = 0.0
    low = 0.0
    for i, count in enumerate(counts):
        high = bounds[i] if i < len(bounds) else math.inf
        if high <= budget:
            within += count
        elif low < budget:
            within += count * (budget - low) / (high - low)
        low = high
    return within / total


@dataclass(frozen=True)
class Point:
    """One period's SLO numbers."""

    start: int
    end: int
    requests: int
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    error_share: float | None
    shed_share: float | None
    ttft_within: float | None  # share of requests whose TTFT met the budget
    tpot_within: float | None

    def met(self, budgets: Budgets) -> bool | None:
        """All three SLOs held; None without traffic."""
        if self.requests == 0 and self.ttft_p90_s is None:
            return None
        return ((self.ttft_p90_s is None or self.ttft_p90_s <= budgets.ttft_p90_s)
                and (self.tpot_p90_s is None or self.tpot_p90_s <= budgets.tpot_p90_s)
                and (self.error_share is None or self.error_share <= budgets.error_share))


def point(counts: Counts, start: int, end: int, budgets: Budgets) -> Point:
    requests = counts.requests
    return Point(
        start=start, end=end, requests=requests,
        ttft_p90_s=histogram_quantile(0.9, LATENCY_BOUNDS, counts.ttft),
        tpot_p90_s=histogram_quantile(0.9, TPOT_BOUNDS, counts.tpot),
        error_share=counts.errors / requests if requests else None,
        shed_share=counts.shed / requests if requests else None,
        ttft_within=share_within(LATENCY_BOUNDS, counts.ttft, budgets.ttft_p90_s),
        tpot_within=share_within(TPOT_BOUNDS, counts.tpot, budgets.tpot_p90_s),
    )


def total(minutes: Mapping[int, Counts], start: int, end: int) -> Counts:
    summed = Counts()
    for minute, counts in minutes.items():
        if start <= minute < end:
            summed.add(counts)
    return summed


@dataclass(frozen=True)
class DayView:
    now: Point  # the last `recent_s`
    day: Point  # the whole day
    points: list[Point]  # the day in steps
    attainment: float | None  # share of the steps with traffic that met every SLO
    steps_with_traffic: int


def day_view(minutes: Mapping[int, Counts], now: float, budgets: Budgets, *, step_s: int = 900,
             recent_s: int = 300, day_s: int = 86400) -> DayView:
    """SLO numbers now (the last `recent_s`, the current minute included) and over the last day in steps."""
    end = int(now // 60) * 60 + 60
    points = []
    first = (end - day_s) // step_s * step_s
    for start in range(first, end, step_s):
        points.append(point(total(minutes, start, start + step_s), start, start + step_s, budgets))
    verdicts = [p.met(budgets) for p in points]
    judged = [v for v in verdicts if v is not None]
    return DayView(
        now=point(total(minutes, end - recent_s, end), end - recent_s, end, budgets),
        day=point(total(minutes, end - day_s, end), end - day_s, end, budgets),
        points=points,
        attainment=sum(judged) / len(judged) if judged else None,
        steps_with_traffic=len(judged),
    )


def chart(view: DayView, budgets: Budgets) -> dict[str, Any]:
    """Chart.js data of the day: p90s against their budgets, and the 5xx and shed shares."""
    import datetime as dt

    labels = [dt.datetime.fromtimestamp(p.start, dt.timezone.utc).strftime("%H:%M") for p in view.points]

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 3)

    def pct(value: float | None) -> float | None:
        return None if value is None else round(value * 100, 4)

    return {
        "latency": {
            "labels": labels,
            "datasets": [
                {"label": "TTFT p90 (ms)", "data": [ms(p.ttft_p90_s) for p in view.points]},
                {
                    "label": f"TTFT budget {budgets.ttft_p90_s * 1000:g} ms",
                    "data": [budgets.ttft_p90_s * 1000] * len(labels),
                    "budget": True,
                },
                {"label": "TPOT p90 (ms)", "data": [ms(p.tpot_p90_s) for p in view.points]},
                {
                    "label": f"TPOT budget {budgets.tpot_p90_s * 1000:g} ms",
                    "data": [budgets.tpot_p90_s * 1000] * len(labels),
                    "budget": True,
                },
            ],
        },
        "errors": {
            "labels": labels,
            "datasets": [
                {"label": "5xx share (%)", "data": [pct(p.error_share) for p in view.points]},
                {"label": "shed share (%)", "data": [pct(p.shed_share) for p in view.points]},
                {
                    "label": f"5xx budget {budgets.error_share * 100:g}%",
                    "data": [budgets.error_share * 100] * len(labels),
                    "budget": True,
                },
            ],
        },
        "requests": {"labels": labels, "datasets": [{"label": "requests", "data": [p.requests for p in view.points]}]},
    }
