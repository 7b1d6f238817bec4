"""Requests and time to first token per LoRA adapter, with bounded label cardinality.

A platform serves hundreds of tenant adapters; a series per adapter name would grow without bound.
`TopLabels` (pure, injected clock) names at most `top` adapters: the busiest by an exponentially
decayed request count (half-life `half_life_s`), re-ranked every `refresh_s`; every other adapter
is counted under `other`. An adapter that leaves the top loses its series (its later requests go
to `other`; Prometheus' `rate()` treats the vanished series as ended), so a gateway exposes at most
`top + 1` series per metric at any time, however many adapters exist. The base model is not an
adapter and is not counted here (`inferbus_ttft_seconds{adapter="base"}` has it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

OTHER = "other"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0)

ADAPTER_REQUESTS = Counter("inferbus_adapter_requests_total",
                           "Requests per LoRA adapter (the busiest adapters by name, the rest as `other`)", ["adapter"])
ADAPTER_TTFT = Histogram("inferbus_adapter_ttft_seconds",
                         "Time to first token per LoRA adapter (the busiest adapters by name, the rest as `other`)",
                         ["adapter"], buckets=_LATENCY)


@dataclass
class TopLabels:
    clock: Callable[[], float]
    top: int = 20
    half_life_s: float = 300.0
    refresh_s: float = 30.0
    named: set[str] = field(default_factory=set)
    _counts: dict[str, tuple[float, float]] = field(default_factory=dict)  # name → (decayed count, at)
    _next_refresh: float | None = None

    def label(self, name: str) -> tuple[str, list[str]]:
        """Count a request for `name`: its label, and the names that just lost theirs."""
        now = self.clock()
        count, at = self._counts.get(name, (0.0, now))
        self._counts[name] = (self._decay(count, now - at) + 1.0, now)
        dropped: list[str] = []
        if self._next_refresh is None or now >= self._next_refresh or (
                name not in self.named and len(self.named) < self.top):
            dropped = self._rerank(now)
        return (name if name in self.named else OTHER), dropped

    def _rerank(self, now: float) -> list[str]:
        self._next_refresh = now + self.refresh_s
        current = {name: self._decay(count, now - at) for name, (count, at) in self._counts.items()}
        # Forget what has decayed to nothing, so the table stays as small as the active adapters.
        self._counts = {name: (value, now) for name, value in current.items() if value >= 0.01}
        best = set(heapq.nlargest(self.top, self._counts, key=lambda name: self._counts[name][0]))
        dropped = sorted(self.named - best)
        self.named = best
        return dropped

    def _decay(self, count: float, elapsed: float) -> float:
        return count * 0.5 ** (max(0.0, elapsed) / self.half_life_s)


class AdapterMetrics:
    """The shell around `TopLabels`: labels requests and removes the series of names that drop out."""

    def __init__(self, labels: TopLabels) -> None:
        self.labels = labels

    def request(self, adapter_name: str) -> str:
        label, dropped = self.labels.label(adapter_name)
        for name in dropped:
            for metric in (ADAPTER_REQUESTS, ADAPTER_TTFT):
                try:
                    metric.remove(name)
                except KeyError:
                    pass
        ADAPTER_REQUESTS.labels(label).inc()
        return label

    @staticmethod
    def first_token(label: str, seconds: float) -> None:
        ADAPTER_TTFT.labels(label).observe(seconds)
