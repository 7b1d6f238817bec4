"""When the platform itself is overloaded: pure policy, injected clock, no I/O.

The gateway feeds it the fleet's live state (worker load reports and the depth of the request
queue per band) and asks, per request, whether its band may still be queued. A band is shed when
the wait a new request can expect exceeds that band's budget: a 503 with `retry-after` now beats
a timeout later. Premium's budget is the larger one, so it is shed last.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from proto import messages as m

BANDS = ("premium", "standard")  # most important first


@dataclass
class _Worker:
    seen: float
    load: m.WorkerLoad
    rate: float = 0.0  # completions per second, smoothed


@dataclass
class OverloadPolicy:
    clock: Callable[[], float]
    budgets_s: dict[str, float] = field(default_factory=lambda: {"premium": 10.0, "standard": 3.0})
    stale_after_s: float = 3.0
    smoothing: float = 0.3  # weight of the newest rate sample
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)  # band → requests waiting in JetStream

    def on_load(self, load: m.WorkerLoad) -> None:
        now = self.clock()
        previous = self._workers.get(load.worker_id)
        worker = _Worker(seen=now, load=load)
        if previous is not None and now > previous.seen and load.completed >= previous.load.completed:
            sample = (load.completed - previous.load.completed) / (now - previous.seen)
            worker.rate = previous.rate + self.smoothing * (sample - previous.rate)
        self._workers[load.worker_id] = worker

    def on_queue_depth(self, band: str, queued: int) -> None:
        self._queued[band] = queued

    def _live(self) -> list[_Worker]:
        now = self.clock()
        return [w for w in self._workers.values() if now - w.seen <= self.stale_after_s and not w.load.draining]

    def free_slots(self) -> int:
        """Slots free across live workers at their last reports (they lag by up to ~250 ms).
        Batch lines count as free: a worker preempts them as soon as interactive work waits."""
        return sum(max(0, w.load.max_running - w.load.in_flight + w.load.batch_in_flight) for w in self._live())

    def expected_wait_s(self, band: str, held_here: int = 0) -> float:
        """Seconds a new request of `band` can expect to wait before an engine starts it.

        `held_here`: requests of that band already waiting in the asking gateway's fair queue.
        """
        live = self._live()
        if not live:
            return 0.0  # no data is not overload; "no workers" is answered elsewhere
        free = self.free_slots()
        ahead = sum(self._queued.get(b, 0) for b in BANDS[: BANDS.index(band) + 1] if b in BANDS)
        ahead += sum(w.load.waiting for w in live) + held_here  # inside the engines and the gateway
        if ahead < free:
            return 0.0
        rate = sum(w.rate for w in live)
        if rate <= 0.0:
            # Full and nothing finished lately: we cannot estimate, and must not guess "infinite".
            return 0.0
        return (ahead - free + 1) / rate

    def admit(self, band: str, held_here: int = 0) -> tuple[bool, float]:
        """(admitted, retry_after_s). Unknown bands are judged by the strictest budget."""
        budget = self.budgets_s.get(band, min(self.budgets_s.values()))
        wait = self.expected_wait_s(band if band in BANDS else BANDS[-1], held_here)
        if wait <= budget:
            return True, 0.0
        return False, float(max(1, math.ceil(wait - budget)))
