"""When the platform itself is overloaded: pure policy, injected clock, no I/O.

The gateway feeds it the fleet's live state (worker load reports and the depth of the request
queue per band) and asks, per request, whether its band may still be queued. A band is shed when
the wait a new request can expect exceeds that band's budget: a 503 with `retry-after` now beats
a timeout later. Premium's budget is the larger one, so it is shed last.

The fleet's completion rate is measured over a sliding window (not from one load report to the
next, which with long answers is mostly zero and occasionally a burst). When work waits and
nothing finished in the whole window, the wait is at least as long as the window has watched:
that is a measurement too, and a full fleet that finishes nothing is the worst overload there is.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from proto import messages as m

BANDS = ("premium", "standard")  # most important first


def bands_through(band: str) -> tuple[str, ...]:
    """`band` and every band more important than it: the work a new request of `band` waits behind.
    An unknown band is judged as the least important one."""
    if band not in BANDS:
        band = BANDS[-1]
    return BANDS[: BANDS.index(band) + 1]


@dataclass
class _Worker:
    seen: float
    load: m.WorkerLoad
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (when, completed) in the window


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    expected_wait_s: float
    retry_after_s: float  # 0 when admitted; else within [1, max_retry_after_s]

    def headers(self) -> dict[str, str]:
        """`retry-after` in whole seconds and `retry-after-ms`, as the OpenAI SDKs read them."""
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s))),
                "retry-after-ms": str(max(1, math.ceil(self.retry_after_s * 1000)))}


@dataclass
class OverloadPolicy:
    clock: Callable[[], float]
    budgets_s: dict[str, float] = field(default_factory=lambda: {"premium": 10.0, "standard": 3.0})
    stale_after_s: float = 10.0
    rate_window_s: float = 30.0  # completions are counted over this much of the recent past
    max_retry_after_s: float = 30.0  # a client is never told to wait longer than this
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)  # band → requests waiting in JetStream

    def on_load(self, load: m.WorkerLoad) -> None:
        now = self.clock()
        worker = self._workers.get(load.worker_id)
        if worker is None or load.completed < worker.load.completed:  # new, or restarted (counter reset)
            worker = self._workers[load.worker_id] = _Worker(seen=now, load=load)
        worker.seen, worker.load = now, load
        worker.samples.append((now, load.completed))
        while len(worker.samples) > 2 and now - worker.samples[1][0] >= self.rate_window_s:
            worker.samples.popleft()

    def on_queue_depth(self, band: str, queued: int) -> None:
        self._queued[band] = queued

    def _live(self) -> list[_Worker]:
        now = self.clock()
        return [w for w in self._workers.values() if now - w.seen <= self.stale_after_s and not w.load.draining]

    def free_slots(self) -> int:
        """Slots free across live workers at their last reports (they lag by up to ~250 ms).
        Batch lines count as free: a worker preempts them as soon as interactive work waits."""
        return sum(max(0, w.load.max_running - w.load.in_flight + w.load.batch_in_flight) for w in self._live())

    def completion_rate(self) -> tuple[float, float]:
        """(completions per second over the window, seconds the window covers) for live workers."""
        rate, watched = 0.0, math.inf
        for worker in self._live():
            first_t, first_n = worker.samples[0]
            span = worker.seen - first_t
            watched = min(watched, span)
            if span > 0:
                rate += (worker.load.completed - first_n) / span
        return rate, (0.0 if watched == math.inf else watched)

    def expected_wait_s(self, band: str, held_here: int = 0) -> float:
        """Seconds a new request of `band` can expect to wait before an engine starts it.

        `held_here`: requests of `band` and more important bands waiting in the asking gateway's
        fair queue.
        """
        live = self._live()
        if not live:
            return 0.0  # no data is not overload; "no workers" is answered elsewhere
        free = self.free_slots()
        ahead = sum(self._queued.get(b, 0) for b in bands_through(band))
        ahead += sum(w.load.waiting for w in live) + held_here  # inside the engines and the gateway
        if ahead < free:
            return 0.0
        rate, watched = self.completion_rate()
        if rate <= 0.0:
            # Full, work waiting, and nothing finished for as long as we have watched: the wait is
            # at least that long (and unknown, so not a guess, while we have watched for nothing).
            return watched
        return (ahead - free + 1) / rate

    def admit(self, band: str, held_here: int = 0) -> Verdict:
        """Whether a request of `band` may queue. Unknown bands are judged by the strictest budget."""
        budget = self.budgets_s.get(band, min(self.budgets_s.values()))
        wait = self.expected_wait_s(band, held_here)
        if wait <= budget:
            return Verdict(True, wait, 0.0)
        # Come back when the excess should have drained, but never later than the cap: the
        # estimate is of now, and a client told to wait minutes would rather be told to try again.
        retry = min(self.max_retry_after_s, max(1.0, math.ceil(wait - budget)))
        return Verdict(False, wait, retry)
