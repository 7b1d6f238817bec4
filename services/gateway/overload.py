"""When the platform itself is overloaded: pure policy, injected clock, no I/O.

The gateway feeds it the fleet's live state (worker load reports and the depth of the request
queue per band) and asks, per request, whether its band may still be queued. A band is shed when
the wait a new request can expect exceeds that band's budget: a 503 with `retry-after` now beats
a timeout later. Premium's budget is the larger one, so it is shed last.

The fleet's completion rate is measured over a sliding window (not from one load report to the
next, which with long answers is mostly zero and occasionally a burst), counting only the time a
worker was full: an idle worker finishes nothing because it has nothing to do, which says nothing
about how fast it frees slots. Until a worker has been full for `min_busy_s` of the window its
rate is unknown; then the wait is at least as long as the fleet has been full without a slot
coming free, a lower bound that sheds once it passes the budget instead of admitting blindly.
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


def _full(load: m.WorkerLoad) -> bool:
    return load.max_running - load.in_flight + load.batch_in_flight <= 0 or load.waiting > 0


@dataclass
class _Worker:
    seen: float
    load: m.WorkerLoad
    # (when, seconds full, completions in them) per report that followed a full one, in the window
    samples: deque[tuple[float, float, int]] = field(default_factory=deque)
    full_since: float | None = None


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
    min_busy_s: float = 2.0  # a worker's rate is known once it was full this long in the window
    max_retry_after_s: float = 30.0  # a client is never told to wait longer than this
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)  # band → requests waiting in JetStream

    def on_load(self, load: m.WorkerLoad) -> None:
        now = self.clock()
        worker = self._workers.get(load.worker_id)
        if worker is None or load.completed < worker.load.completed:  # new, or restarted (counter reset)
            worker = self._workers[load.worker_id] = _Worker(seen=now, load=load)
        elif _full(worker.load) and now > worker.seen:
            worker.samples.append((now, now - worker.seen, load.completed - worker.load.completed))
        while worker.samples and now - worker.samples[0][0] > self.rate_window_s:
            worker.samples.popleft()
        if not _full(load):
            worker.full_since = None
        elif worker.full_since is None:
            worker.full_since = now
        worker.seen, worker.load = now, load

    def on_queue_depth(self, band: str, queued: int) -> None:
        self._queued[band] = queued

    def _live(self) -> list[_Worker]:
        now = self.clock()
        return [w for w in self._workers.values() if now - w.seen <= self.stale_after_s and not w.load.draining]

    def free_slots(self) -> int:
        """Slots free across live workers at their last reports (they lag by up to ~250 ms).
        Batch lines count as free: a worker preempts them as soon as interactive work waits."""
        return sum(max(0, w.load.max_running - w.load.in_flight + w.load.batch_in_flight) for w in self._live())

    def completion_rate(self) -> float | None:
        """Completions per second of the live workers while full, over the window; None while
        some live worker has not been full long enough to tell (its slots may free at any rate)."""
        rate = 0.0
        for worker in self._live():
            busy = sum(dt for _, dt, _ in worker.samples)
            if busy < self.min_busy_s:
                return None
            rate += sum(n for _, _, n in worker.samples) / busy
        return rate

    def full_for_s(self) -> float:
        """How long every live worker has been full (0 when one has a free slot)."""
        now = self.clock()
        live = self._live()
        if not live or any(w.full_since is None for w in live):
            return 0.0
        return now - max(w.full_since for w in live if w.full_since is not None)

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
        rate = self.completion_rate()
        if rate is None or rate <= 0.0:
            # Unknown (or nothing finished while full): the wait is at least as long as the fleet
            # has been full, a lower bound, and never a guess beyond what was seen.
            return self.full_for_s()
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
