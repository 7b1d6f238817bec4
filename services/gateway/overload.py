"""When the platform itself is overloaded: pure policy, injected clock, no I/O.

The gateway feeds it the fleet's live state (worker load reports and the depth of the request
queue per band) and asks, per request, whether its band may still be queued. A band is shed when
the wait a new request can expect exceeds that band's budget: a 503 with `retry-after` now beats
a timeout later. Premium's budget is the larger one, so it is shed last.

The fleet's completion rate is measured over a sliding window (not from one load report to the
next, which with long answers is mostly zero and occasionally a burst; the window reaches back
further while it holds fewer than `min_completions`, so long answers and idle spells keep their
measurement) as occupied slot-seconds per completion (Little's law): a worker with `max_running` slots, whose requests
each hold a slot for S seconds on average, frees `max_running / S` slots a second when full. Idle or half-idle time
therefore does not dilute the rate. Until a worker's slots were occupied for `min_busy_s`
slot-seconds of the window its rate is unknown; then the wait is at least the time since the
fleet last made progress (a completion, or a free slot), a lower bound that sheds once it passes
the budget instead of admitting blindly.

A request the router places on one worker's own queue (prefix or adapter affinity) waits for
that worker, not for the fleet: the pooled estimate does not bound its wait. So a placement is
checked too (`placement_fits`): the same estimate for that one worker (its own queue, its engine's
waiting requests, its free slots and its own rate) must fit the band's budget, or the request goes
to the shared queue, which every worker pulls and the pooled estimate does bound.

The wait compared with the budget is not the mean but its `quantile` (90%): with n requests to
start before this one and slots freeing at random at the measured rate r, the wait is the time of
the n-th event of a Poisson process, Gamma(n, 1/r). Admitting on the mean would let half of the
requests near the limit wait longer than the budget.

The model counts slots as the workers report them; a slot that is reported free but does not
start work in time (a worker that does not pull, an engine too starved to run what it was given)
fools it. So the gateway also measures how long starting actually takes (`start_lag_s`): the
`quantile` of the times to first token of the requests of the band (and more important bands)
that started in the last `start_window_s`, together with the ages of those still waiting for
their first token (each a lower bound of its own); and how long the request at the head of the
line has waited for a worker so far (`oldest_waiting_s`, the queue's sojourn time, as CoDel
measures it: a new request joins the same line); both only of requests on their first attempt,
since a retried one waited for a worker's failure, not for capacity. The wait a new request can expect is the largest
of the three, so requests are shed while the ones admitted before them are not starting within
the budget, whatever the reports say.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proto import bands, subjects
from proto import messages as m


def poisson_wait_quantile(n: int, rate: float, quantile: float) -> float:
    """Seconds until the n-th event of a Poisson process of `rate` has happened with probability
    `quantile` (the quantile of Gamma(n, 1/rate))."""
    if n <= 0:
        return 0.0
    if n > 50:  # normal approximation, plenty accurate this far out
        z = _normal_quantile(quantile)
        return (n + z * math.sqrt(n)) / rate
    # P(T_n <= t) = P(at least n events by t); bisection on x = rate * t.
    low, high = 0.0, n + 10.0 * math.sqrt(n) + 10.0
    for _ in range(50):
        x = (low + high) / 2
        term, below = math.exp(-x), 0.0  # P(fewer than n events)
        for k in range(n):
            below += term
            term *= x / (k + 1)
        if 1.0 - below < quantile:
            low = x
        else:
            high = x
    return high / rate


def _normal_quantile(p: float) -> float:
    """The standard normal quantile (bisection on erf; p in (0, 1))."""
    low, high = -10.0, 10.0
    for _ in range(60):
        mid = (low + high) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            low = mid
        else:
            high = mid
    return high


def _serves(load: m.WorkerLoad, band: str) -> bool:
    """Whether the worker pulls `band`'s queues (a worker that does not say pulls every band)."""
    return not load.bands or band in load.bands


def _free(load: m.WorkerLoad) -> int:
    """Free slots in a load report. Batch lines count as free: a worker preempts them as soon as
    interactive work waits."""
    return max(0, load.max_running - load.in_flight + load.batch_in_flight)


@dataclass
class _Worker:
    seen: float
    load: m.WorkerLoad
    # (when, occupied slot-seconds, completions) per interval between two reports, in the window
    samples: deque[tuple[float, float, int]] = field(default_factory=deque)
    slot_seconds: float = 0.0  # sums over `samples`
    completions: int = 0
    progress_at: float = 0.0  # this worker's last report with a new completion or a free slot

    def add(self, sample: tuple[float, float, int]) -> None:
        self.samples.append(sample)
        self.slot_seconds += sample[1]
        self.completions += sample[2]

    def rate(self, min_busy_s: float) -> float | None:
        """Slots this worker frees per second when full; None until its slots were occupied for
        `min_busy_s` slot-seconds of the window."""
        if self.slot_seconds < min_busy_s:
            return None
        return self.load.max_running * self.completions / self.slot_seconds

    def forget_before(self, cutoff: float, hard_cutoff: float, min_completions: int) -> None:
        """Drop samples older than `cutoff` while enough completions remain; older than
        `hard_cutoff` in any case."""
        while self.samples:
            when, slots, done = self.samples[0]
            if when >= cutoff or (when >= hard_cutoff and self.completions - done < min_completions):
                return
            self.samples.popleft()
            self.slot_seconds -= slots
            self.completions -= done


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
    rate_window_s: float = 30.0  # completions are counted over this much of the recent past...
    min_completions: int = 8  # ...or further back, until it holds this many...
    max_window_s: float = 600.0  # ...but never further than this
    min_busy_s: float = 2.0  # a worker's rate is known once its slots were occupied this many slot-seconds
    max_retry_after_s: float = 30.0  # a client is never told to wait longer than this
    quantile: float = 0.9  # of the wait, compared with the budget
    start_window_s: float = 10.0  # measured starts (times to first token) are kept this long; 0: not measured
    min_starts: int = 5  # the measured start lag counts once this many samples are at hand
    _starts: deque[tuple[float, str, float]] = field(default_factory=deque)  # (when, band, seconds to first token)
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)  # band → requests waiting in JetStream
    # (worker token, band) → requests waiting in that worker's own queue in JetStream
    _queued_on: dict[tuple[str, str], int] = field(default_factory=dict)
    _progress_at: float | None = None  # last report with a new completion or a free slot

    def on_load(self, load: m.WorkerLoad) -> None:
        now = self.clock()
        worker = self._workers.get(load.worker_id)
        if worker is None or load.completed < worker.load.completed:  # new, or restarted (counter reset)
            worker = self._workers[load.worker_id] = _Worker(seen=now, load=load, progress_at=now)
            self._progress_at = now  # watched from here on
        elif now > worker.seen:
            # Slots held during the interval: as the previous report had them (requests that
            # started or ended inside it are too short a part of it to matter on average).
            occupied = min(worker.load.in_flight - worker.load.batch_in_flight, worker.load.max_running)
            completed = load.completed - worker.load.completed
            worker.add((now, max(0, occupied) * (now - worker.seen), completed))
            if completed > 0:
                self._progress_at = worker.progress_at = now
        worker.forget_before(now - self.rate_window_s, now - self.max_window_s, self.min_completions)
        if _free(load) > 0:
            self._progress_at = worker.progress_at = now
        worker.seen, worker.load = now, load

    def on_queue_depth(self, band: str, queued: int, by_worker: dict[str, int] | None = None) -> None:
        """`queued`: requests of `band` waiting in JetStream, in the shared queue and every
        worker's own; `by_worker`: those in each worker's own queue (by `subjects.token(worker_id)`)."""
        self._queued[band] = queued
        if by_worker is not None:
            for key in [key for key in self._queued_on if key[1] == band]:
                del self._queued_on[key]
            for worker, count in by_worker.items():
                self._queued_on[(worker, band)] = count

    def _live(self) -> list[_Worker]:
        now = self.clock()
        return [w for w in self._workers.values() if now - w.seen <= self.stale_after_s and not w.load.draining]

    def free_slots(self) -> int:
        """Slots free across live workers at their last reports (they lag by up to ~250 ms).
        Batch lines count as free: a worker preempts them as soon as interactive work waits."""
        return sum(_free(w.load) for w in self._live())

    def worker_free_slots(self, worker_id: str, fresh_s: float = 2.0) -> int | None:
        """A worker's free slots at its last load report; None when it sent none for `fresh_s`."""
        worker = self._workers.get(worker_id)
        if worker is None or self.clock() - worker.seen > fresh_s:
            return None
        return _free(worker.load)

    def completion_rate(self, band: str | None = None) -> float | None:
        """Slots the live workers (those that pull `band`, if given) free per second when full
        (each: max_running / mean seconds a request holds a slot, over the window); None while a
        worker's rate is not known yet."""
        total = 0.0
        for worker in self._live():
            if band is not None and not _serves(worker.load, band):
                continue
            rate = worker.rate(self.min_busy_s)
            if rate is None:
                return None
            total += rate
        return total

    def stalled_for_s(self) -> float:
        """Seconds since the fleet last made progress: a completion, or a free slot."""
        if self._progress_at is None:
            return 0.0
        return self.clock() - self._progress_at

    def expected_wait_s(self, band: str, held_here: int = 0, queued_here: int = 0) -> float:
        """Seconds within which a new request of `band` starts, with probability `quantile`.

        `held_here`: requests of `band` and more important bands waiting in the asking gateway's
        fair queue; `queued_here`: those it published that no worker accepted yet (the polled
        queue depth counts them too, but late: a burst would otherwise all see the same queue).
        """
        live = self._live()
        if not live:
            return 0.0  # no data is not overload; "no workers" is answered elsewhere
        # Only the slots of workers that pull this band can take the request.
        free = sum(_free(w.load) for w in live if _serves(w.load, band))
        ahead = max(queued_here, sum(self._queued.get(b, 0) for b in bands.through(band)))
        ahead += sum(w.load.waiting for w in live) + held_here  # inside the engines and the gateway
        if ahead < free:
            return 0.0
        rate = self.completion_rate(band)
        if rate is None or rate <= 0.0:
            # Unknown (or nothing finished): the wait is at least as long as the fleet has made
            # no progress, a lower bound, and never a guess beyond what was seen.
            return self.stalled_for_s()
        return poisson_wait_quantile(ahead - free + 1, rate, self.quantile)

    def worker_wait_s(self, worker_id: str, band: str, queued_here: int = 0) -> float | None:
        """Seconds within which a new request of `band` queued on `worker_id`'s own queue starts,
        with probability `quantile`; None when that worker is not live (stale, draining, unknown).

        `queued_here`: requests of `band` and more important bands this gateway queued on that
        worker that it has not started yet (the polled depth counts them too, but late).
        """
        worker = self._workers.get(worker_id)
        if worker is None or self.clock() - worker.seen > self.stale_after_s or worker.load.draining:
            return None
        key = subjects.token(worker_id)
        ahead = max(queued_here, sum(self._queued_on.get((key, b), 0) for b in bands.through(band)))
        ahead += worker.load.waiting
        free = _free(worker.load)
        if ahead < free:
            return 0.0
        rate = worker.rate(self.min_busy_s)
        if rate is None or rate <= 0.0:
            return self.clock() - worker.progress_at  # a lower bound, as for the fleet
        return poisson_wait_quantile(ahead - free + 1, rate, self.quantile)

    def placement_fits(self, worker_id: str, band: str, queued_here: int = 0) -> bool:
        """Whether a request of `band` may wait on `worker_id`'s own queue: its expected wait there
        fits the band's budget. Otherwise it belongs on the shared queue, where any worker takes it
        (and which `admit` bounds). A worker it has no recent report of is the router's call: no
        data is not overload."""
        wait = self.worker_wait_s(worker_id, band, queued_here)
        return wait is None or wait <= self._budget(band)

    def on_started(self, band: str, seconds: float) -> None:
        """A request of `band` this gateway admitted got its first token `seconds` after admission."""
        if self.start_window_s <= 0:
            return
        now = self.clock()
        self._starts.append((now, band, seconds))
        while self._starts and self._starts[0][0] < now - self.start_window_s:
            self._starts.popleft()

    def start_lag_s(self, band: str, unstarted_ages: Sequence[float] = ()) -> float:
        """Seconds to first token of the requests of `band` and more important bands, at `quantile`:
        of those that started in the last `start_window_s`, and the ages of those still waiting for
        their first token (`unstarted_ages`, lower bounds of theirs). 0 with fewer than
        `min_starts` samples."""
        if self.start_window_s <= 0:
            return 0.0
        cutoff = self.clock() - self.start_window_s
        ahead = bands.through(band)
        samples = [seconds for when, b, seconds in self._starts if when >= cutoff and b in ahead]
        samples.extend(unstarted_ages)
        if len(samples) < self.min_starts:
            return 0.0
        samples.sort()
        return samples[min(len(samples) - 1, math.ceil(self.quantile * len(samples)) - 1)]

    def _budget(self, band: str) -> float:
        return self.budgets_s.get(band, min(self.budgets_s.values()))

    def admit(self, band: str, held_here: int = 0, queued_here: int = 0,
              unstarted_ages: Sequence[float] = (), oldest_waiting_s: float = 0.0) -> Verdict:
        """Whether a request of `band` may queue. Unknown bands are judged by the strictest budget.
        `unstarted_ages`: seconds since admission of this gateway's requests of `band` and more
        important bands that have no first token yet; `oldest_waiting_s`: how long the one of them
        that has waited longest for a worker (not accepted yet) has waited so far."""
        budget = self._budget(band)
        measured = oldest_waiting_s if self.start_window_s > 0 else 0.0
        wait = max(self.expected_wait_s(band, held_here, queued_here), self.start_lag_s(band, unstarted_ages), measured)
        if wait <= budget:
            return Verdict(True, wait, 0.0)
        # Come back when the excess should have drained, but never later than the cap: the
        # estimate is of now, and a client told to wait minutes would rather be told to try again.
        retry = min(self.max_retry_after_s, max(1.0, math.ceil(wait - budget)))
        return Verdict(False, wait, retry)
