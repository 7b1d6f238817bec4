"""Worker load reports → one `PoolSignals` snapshot per model pool. Pure: injected clock, no I/O.

Workers publish `WorkerLoad` event-driven (at most every 20 ms, at least every load interval).
Counters in the reports (completions, latency histograms) are cumulative, so the difference
between a worker's oldest report inside the window and its newest is exact over that span, and
a lost report costs nothing. Rates and percentiles are summed over workers, so workers joining or
leaving mid-window only lose their own unseen part.

What the reports cannot see: requests still waiting in a gateway's fair queue. Their wait shows up
as measured queue wait (gateway accept → engine submit) once they start, which is why the queue
wait signal is the larger of the measured p90 and the estimate from what engines hold waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proto import messages as m


@dataclass(frozen=True)
class PoolSignals:
    """Everything the policy looks at for one pool, at one instant. Plain values, so a fleet
    simulator can build one directly. Rates are interactive requests per second; latencies are
    seconds over the recent window (None: too few observations to say)."""

    pool: str
    serving: int = 0  # pulling work
    warm: int = 0  # engine loaded, idle, promotable in seconds
    starting: int = 0  # launched, still loading (cold start)
    draining: int = 0  # finishing their work, then gone (or back to warm)
    slots: int = 0  # request slots across serving replicas
    arrival_rate: float = 0.0  # interactive: completions plus queue growth
    batch_rate: float = 0.0  # batch band completions (filler: never a reason to scale up)
    waiting: int = 0  # interactive requests held by engines but not yet running
    running: int = 0
    in_flight: int = 0  # interactive requests held by workers
    batch_in_flight: int = 0
    queue_wait_s: float = 0.0  # p90 measured over the window, or the current estimate if larger
    kv_usage: float = 0.0  # highest KV cache use across serving replicas (0-1)
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    # Serving replicas least loaded first (cheapest to demote) and warm ones, for the reconciler.
    serving_ids: tuple[str, ...] = ()
    warm_ids: tuple[str, ...] = ()


@dataclass
class _Sample:
    t: float
    completed: int  # interactive
    completed_batch: int
    in_flight: int  # interactive
    ttft: list[int]
    queue_wait: list[int]
    tpot: list[int]


@dataclass
class _Worker:
    model: str
    last: m.WorkerLoad
    seen: float
    history: deque[_Sample] = field(default_factory=deque)






@dataclass
class SignalAggregator:
    clock: Callable[[], float]
    rate_window_s: float = 10.0  # rates: short, so a ramp shows quickly
    latency_window_s: float = 30.0  # percentiles: longer, so a p90 rests on enough requests
    stale_after_s: float = 3.0  # a worker silent this long is gone (the heartbeat TTL)
    min_latency_samples: int = 5  # fewer requests than this in the window: no percentile
    _workers: dict[str, _Worker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rate_window_s <= 0 or self.latency_window_s <= 0 or self.stale_after_s <= 0:
            raise ValueError("signal windows and staleness must be positive")

    def on_load(self, load: m.WorkerLoad) -> None:
        now = self.clock()
        worker = self._workers.get(load.worker_id)
        if worker is None or load.completed < worker.last.completed:  # new, or restarted
            worker = self._workers[load.worker_id] = _Worker(load.model, load, now)
        worker.last, worker.seen, worker.model = load, now, load.model
        worker.history.append(_Sample(
            now, load.completed - load.completed_batch, load.completed_batch, load.in_flight - load.batch_in_flight,
            list(load.ttft_hist), list(load.queue_wait_hist), list(load.tpot_fine_hist),
        ))
        keep = max(self.rate_window_s, self.latency_window_s)
        # Keep one sample older than the window: it is the baseline the window's deltas start from.
        while len(worker.history) > 2 and now - worker.history[1].t > keep:
            worker.history.popleft()

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def pools(self) -> list[str]:
        return sorted({w.model for w in self._live().values()})

    def _live(self) -> dict[str, _Worker]:
        now = self.clock()
        for worker_id in [wid for wid, w in self._workers.items() if now - w.seen > self.stale_after_s]:
            del self._workers[worker_id]
        return self._workers

    def snapshot(self, pool: str, role: str | None = None, name: str | None = None) -> PoolSignals:
        """The pool's signals; with `role`, of its workers of that role only (a disaggregated fleet's
        prefill or decode pool, sized apart), named `name` in the snapshot."""
        now = self.clock()
        workers = [(wid, w) for wid, w in self._live().items()
                   if w.model == pool and (role is None or w.last.role == role)]
        serving = [(wid, w) for wid, w in workers if w.last.phase == "serving" and not w.last.draining]
        warm = sorted(wid for wid, w in workers if w.last.phase == "warm" and not w.last.draining)
        starting = sum(1 for _, w in workers if w.last.phase == "starting")
        draining = sum(1 for _, w in workers if w.last.draining)

        arrival = batch_rate = 0.0
        ttft = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
        queue = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
        tpot = [0] * (len(m.TPOT_BUCKETS_S) + 1)
        for _, w in workers:
            newest = w.history[-1]
            base = _baseline(w.history, now - self.rate_window_s)
            if base is not None and newest.t > base.t:
                span = newest.t - base.t
                completed = newest.completed - base.completed
                arrival += max(0.0, (completed + newest.in_flight - base.in_flight) / span)
                batch_rate += max(0.0, (newest.completed_batch - base.completed_batch) / span)
            base = _baseline(w.history, now - self.latency_window_s)
            if base is not None:
                for total, new, old in ((ttft, newest.ttft, base.ttft), (queue, newest.queue_wait, base.queue_wait),
                                        (tpot, newest.tpot, base.tpot)):
                    for i, count in enumerate(m.hist_delta(new, old, len(total))):
                        total[i] += count

        loads = [w.last for _, w in workers if not w.last.draining]
        in_flight = sum(x.in_flight - x.batch_in_flight for x in loads)
        batch_in_flight = sum(x.batch_in_flight for x in loads)
        # Engines run interactive requests first (priority scheduling), so the batch ones are the
        # waiting ones as far as there are any.
        waiting = max(0, sum(x.waiting for x in loads) - batch_in_flight)
        completions = sum(_rate_of_completions(w.history, now - self.rate_window_s) for _, w in workers)
        estimate = waiting / completions if completions > 0 else 0.0
        measured = self._p90(queue, m.LATENCY_BUCKETS_S) or 0.0
        serving_loads = [w.last for _, w in serving]
        return PoolSignals(
            pool=name or pool, serving=len(serving), warm=len(warm), starting=starting, draining=draining,
            slots=sum(x.max_running for x in serving_loads),
            arrival_rate=arrival, batch_rate=batch_rate, waiting=waiting,
            running=sum(x.running for x in loads), in_flight=in_flight, batch_in_flight=batch_in_flight,
            queue_wait_s=max(measured, estimate),
            kv_usage=max((x.kv_used_tokens / x.kv_capacity_tokens for x in serving_loads if x.kv_capacity_tokens),
                         default=0.0),
            ttft_p90_s=self._p90(ttft, m.LATENCY_BUCKETS_S), tpot_p90_s=self._p90(tpot, m.TPOT_BUCKETS_S),
            serving_ids=tuple(wid for wid, w in sorted(serving, key=lambda item: (item[1].last.in_flight, item[0]))),
            warm_ids=tuple(warm),
        )

    def _p90(self, counts: list[int], bounds: Sequence[float]) -> float | None:
        if sum(counts) < self.min_latency_samples:
            return None
        return m.hist_percentile(counts, bounds, 0.9)


def _baseline(history: deque[_Sample], since: float) -> _Sample | None:
    """The newest sample at or before `since` (the window's start), else the oldest one."""
    if not history:
        return None
    base = history[0]
    for sample in history:
        if sample.t > since:
            break
        base = sample
    return base


def _rate_of_completions(history: deque[_Sample], since: float) -> float:
    base, newest = _baseline(history, since), history[-1] if history else None
    if base is None or newest is None or newest.t <= base.t:
        return 0.0
    return max(0.0, (newest.completed - base.completed) / (newest.t - base.t))
