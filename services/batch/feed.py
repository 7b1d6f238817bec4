"""How many batch lines may be in the fleet right now. Pure: injected clock, no I/O.

The simulator drives this same object with simulated `WorkerLoad` reports, so the live service
and the fleet-scale proof share one policy.

What "spare" means under continuous batching
--------------------------------------------
A free engine slot is not free capacity. Every running sequence lengthens the engine step that
all sequences share (the roofline in inferbus/timing.py: `t_step = T0 + t_w + c_seq·B + t_kv(S) + ...`; H100 TP2 at
2k context: 18.6 ms at B=1, 23.7 at 32, 29.0 at 64, 39.6 at 128), and each batch line's prefill
takes chunked-prefill budget from interactive prompts. So every batch line costs interactive
requests some TPOT and TTFT. The goal is not "fill every slot" but "fill as much as possible while
interactive p90 TTFT and TPOT stay within ~10% of what they would be without batch".

Two limits follow, and the policy takes the smaller:

1. A per-worker cap from the step-time model (feed-forward, no lag). With the step linear in the
   running count, `t(B) ≈ base + per_seq·B`, adding `b` batch sequences next to `i` interactive
   ones slows the step by `per_seq·b / (base + per_seq·i)`. Keeping that at most `max_slowdown`
   gives `b ≤ max_slowdown · (base/per_seq + i)`: about 11 + 0.1·i lines per H100 TP2 worker at
   10% (`inferbus.step_cost`, with each worker's GPU and TP as it reports them). A worker also
   keeps `reserve_slots` free for interactive arrivals, and never goes past
   its `max_running` (which counts interactive and batch work alike). Summed over serving,
   non-draining workers this is `spare`.
   A worker under local pressure gets no share of spare (cap 0) while the rest of the fleet keeps
   being fed: more than `waiting_tolerance` INTERACTIVE requests waiting in its engine
   (`waiting − batch_waiting`: batch lines queued for prefill in the engine are not interactive
   work kept waiting), or its KV use above `kv_ceiling`.
2. A target adapted AIMD-style from the fleet's interactive latency (feedback): interactive p90
   TTFT, queue wait or TPOT over the last `window_s` (from the cumulative histograms in WorkerLoad,
   interactive requests only) above its budget. The TTFT and TPOT budgets are RELATIVE: the
   promise is "within 10% of interactive alone", so the budget is `(1 + latency_tolerance) ×` a
   baseline the policy learns, capped at `pressure_fraction` of the SLO. The baseline is the p90
   of a window in which batch was light (at most `light_per_worker` batch lines per serving worker
   on average, and at least `baseline_min_samples` interactive completions), smoothed in time
   (`baseline_tau_s`) over such windows; with interactive work present, the feed learns for
   `baseline_wait_s` after its first report before it feeds at all (without one the budget is
   `pressure_fraction` × SLO). Batch
   is light whenever the batch queue runs dry, so the baseline follows the interactive load over
   the day without ever absorbing batch's own cost. The queue-wait budget stays absolute
   (`pressure_fraction` × `queue_wait_budget_s`). Over budget the target drops by
   `decrease_factor` at most every `decrease_every_s` and `allowance` is 0, while workers preempt
   running batch lines to make room (their PreemptionPolicy). Without pressure the target grows by
   `increase_per_s` lines per second per serving worker, towards `spare` (never above it), after
   `hold_after_pressure_s` of calm.

The caps are feed-forward because latency feedback lags by a window and by the lines already
running; the feedback catches what the model misses (long batch prompts, KV-heavy contexts,
a different GPU than the constants describe).

`allowance(outstanding)` is the room left: `min(target, spare) − outstanding`, where outstanding
counts lines published and without a result (queued in JetStream or running).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inferbus import step_cost
from inferbus.step_cost import StepCost
from proto import messages as m


@dataclass(frozen=True)
class FeedConfig:
    ttft_slo_s: float = 0.8  # interactive p90 time to first token to protect
    tpot_slo_s: float = 0.04  # interactive p90 time per output token to protect
    queue_wait_budget_s: float = 0.5  # interactive p90 accept → engine start to protect
    # Latency budgets never pass this share of their SLO. 1.0 since TPOT buckets are 1 ms wide
    # (2.5% at the 40 ms SLO): 5 ms buckets read a p90 high and needed 0.98.
    pressure_fraction: float = 1.0
    # TTFT/TPOT budget: the learned alone-baseline p90 × (1 + this), under the 10% promise because
    # the window lags and the lines already running outlast a pause.
    latency_tolerance: float = 0.09
    light_per_worker: float = 0.5  # batch lines per serving worker (mean) under which a window is "alone"
    baseline_min_samples: int = 50  # interactive completions a window needs to set the baseline
    baseline_tau_s: float = 5.0  # time constant of the baseline's smoothing over light windows
    baseline_wait_s: float = 15.0  # after the first report, learn the baseline this long before feeding
    # (only while interactive work is there to learn from: an idle fleet is fed at once)
    kv_ceiling: float = 0.9  # a worker whose KV cache is this full gets no batch share
    waiting_tolerance: int = 2  # interactive requests waiting in an engine before that worker gets no share
    window_s: float = 10.0  # latency window: long enough that a p90 is not noise, short enough to follow
    min_latency_samples: int = 5  # fewer interactive completions in the window: no latency verdict
    stale_after_s: float = 3.0  # a worker silent this long is gone (its slots are not spare)
    # Step-time model of an engine whose GPU the timing model does not know (`inferbus.step_cost`;
    # workers report theirs): H100 TP2 latency preset, 2k context.
    step_base_s: float = step_cost.DEFAULT.base_s  # step time with one sequence
    step_per_seq_s: float = step_cost.DEFAULT.per_seq_s  # added per running sequence
    max_slowdown: float = 0.06  # step-time increase batch may cause (under the 10% promise, leaving room for prefill)
    reserve_slots: int = 4  # slots per worker kept free for interactive arrivals
    initial_per_worker: float = 2.0  # target per serving worker at start and after a reset
    increase_per_s: float = 2.0  # additive increase, lines per second per serving worker
    # Multiplicative decrease per pressure step, at most one per `decrease_every_s`: gentle, as
    # the latency window lags (a slow window stays pressure for up to `window_s`; halving every
    # half second through it would empty the fleet of batch for one noisy window) and the
    # per-worker step-time cap already bounds what batch can cost.
    decrease_factor: float = 0.7
    decrease_every_s: float = 2.5
    hold_after_pressure_s: float = 2.0  # calm needed before growing again

    def __post_init__(self) -> None:
        if not 0 < self.pressure_fraction <= 1 or not 0 < self.kv_ceiling <= 1:
            raise ValueError("pressure_fraction and kv_ceiling must be in (0, 1]")
        if not 0 <= self.decrease_factor < 1:
            raise ValueError("decrease_factor must be in [0, 1)")
        if min(self.window_s, self.stale_after_s, self.step_base_s, self.step_per_seq_s) <= 0:
            raise ValueError("windows and step-time constants must be positive")
        if self.latency_tolerance < 0 or self.light_per_worker < 0 or self.baseline_tau_s <= 0:
            raise ValueError("latency_tolerance and light_per_worker must be >= 0, baseline_tau_s > 0")
        if self.max_slowdown < 0 or self.reserve_slots < 0 or self.increase_per_s < 0:
            raise ValueError("max_slowdown, reserve_slots and increase_per_s must be >= 0")


@dataclass(frozen=True)
class FeedState:
    target: float  # lines the AIMD loop allows in the fleet
    spare: int  # lines the fleet's workers can take without passing their caps
    pressure: bool
    reason: str  # why, in words: the signal that set the state
    workers: int = 0  # serving workers counted
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    queue_wait_p90_s: float | None = None
    ttft_budget_s: float | None = None  # the latency budgets in force (relative to the baseline, capped)
    tpot_budget_s: float | None = None
    pressured_workers: int = 0  # serving workers given no share (interactive waiting, KV)


@dataclass
class _Sample:
    t: float
    ttft: list[int]
    queue_wait: list[int]
    tpot: list[int]


@dataclass
class _Worker:
    last: m.WorkerLoad
    seen: float
    history: deque[_Sample] = field(default_factory=deque)






class FeedPolicy:
    def __init__(self, clock: Callable[[], float], config: FeedConfig = FeedConfig()) -> None:
        self.clock = clock
        self.config = config
        # For workers whose GPU the timing model does not know.
        self._fallback_cost = StepCost(config.step_base_s, config.step_per_seq_s)
        self._workers: dict[str, _Worker] = {}
        self._target = 0.0
        self._last_update: float | None = None
        self._last_decrease = -math.inf
        self._last_pressure = -math.inf
        self._state = FeedState(target=0.0, spare=0, pressure=False, reason="no worker reports yet")
        self._first_report: float | None = None
        self._baseline_ttft: float | None = None  # interactive p90s learned while batch was light
        self._baseline_tpot: float | None = None
        self._last_learn: float | None = None

    def observe(self, load: m.WorkerLoad) -> None:
        now = self.clock()
        if self._first_report is None:
            self._first_report = now
        worker = self._workers.get(load.worker_id)
        if worker is None:
            worker = self._workers[load.worker_id] = _Worker(load, now)
        worker.last, worker.seen = load, now
        worker.history.append(_Sample(now, list(load.ttft_hist), list(load.queue_wait_hist), list(load.tpot_fine_hist)))
        # One sample older than the window stays: it is the baseline the window's deltas start from.
        while len(worker.history) > 2 and now - worker.history[1].t > self.config.window_s:
            worker.history.popleft()
        # No decision here: reports arrive many times a second per worker; `allowance` and `state`
        # decide, over every worker at once.

    def allowance(self, outstanding: int) -> int:
        now = self.clock()
        self._update(now)
        state = self._state
        if state.pressure:
            return 0
        return max(0, min(int(state.target), state.spare) - outstanding)

    def state(self) -> FeedState:
        self._update(self.clock())
        return self._state

    # ---- internals ----------------------------------------------------------------------

    def _serving(self, now: float) -> list[_Worker]:
        c = self.config
        for worker_id in [wid for wid, w in self._workers.items() if now - w.seen > c.stale_after_s]:
            del self._workers[worker_id]
        return [w for w in self._workers.values()
                if w.last.phase == "serving" and not w.last.draining and w.last.max_running > 0]

    def baseline(self) -> tuple[float | None, float | None]:
        """The learned interactive-alone p90 (TTFT, TPOT), None until a light window was seen."""
        return self._baseline_ttft, self._baseline_tpot

    def worker_pressure(self, load: m.WorkerLoad) -> str:
        """Why this worker gets no batch share now ('' if it may have one)."""
        c = self.config
        interactive_waiting = max(0, load.waiting - load.batch_waiting)
        if load.in_flight > load.batch_in_flight and interactive_waiting > c.waiting_tolerance:
            return f"{interactive_waiting} interactive request(s) waiting in its engine"
        if load.kv_capacity_tokens and load.kv_used_tokens / load.kv_capacity_tokens > c.kv_ceiling:
            return f"KV cache {load.kv_used_tokens / load.kv_capacity_tokens:.0%} full"
        return ""

    def worker_cap(self, load: m.WorkerLoad) -> int:
        """Batch lines this worker may hold: the smaller of the step-time cap and the free slots
        (interactive work and the reserve first)."""
        c = self.config
        interactive_running = max(0, load.in_flight - load.batch_in_flight)
        # The engine's own GPU and TP when the timing model knows them, else the configured constants.
        cost = step_cost.step_cost(load.gpu, load.tp, self._fallback_cost)
        by_step = step_cost.batch_cap(c.max_slowdown, cost.seqs, interactive_running)
        by_slots = load.max_running - interactive_running - c.reserve_slots
        return max(0, min(by_step, by_slots))

    def _update(self, now: float) -> None:
        c = self.config
        workers = self._serving(now)
        spare = 0
        pressured: list[str] = []
        ttft = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
        queue = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
        tpot = [0] * (len(m.TPOT_BUCKETS_S) + 1)
        batch_lines = 0
        for w in workers:
            newest, base = w.history[-1], w.history[0]
            if newest is not base:
                for total, new, old in ((ttft, newest.ttft, base.ttft), (queue, newest.queue_wait, base.queue_wait),
                                        (tpot, newest.tpot, base.tpot)):
                    for i, count in enumerate(m.hist_delta(new, old, len(total))):
                        total[i] += count
            batch_lines += w.last.batch_in_flight
            why = self.worker_pressure(w.last)
            if why:
                pressured.append(why)  # this worker gets no share; the rest of the fleet is still fed
            else:
                spare += self.worker_cap(w.last)
        ttft_p90 = self._p90(ttft, m.LATENCY_BUCKETS_S)
        queue_p90 = self._p90(queue, m.LATENCY_BUCKETS_S)
        tpot_p90 = self._p90(tpot, m.TPOT_BUCKETS_S)
        if workers and batch_lines <= c.light_per_worker * len(workers) and sum(tpot) >= c.baseline_min_samples:
            self._learn(now, ttft_p90, tpot_p90)
        ttft_budget = self._budget(self._baseline_ttft, c.ttft_slo_s)
        tpot_budget = self._budget(self._baseline_tpot, c.tpot_slo_s)
        interactive = sum(ttft) > 0 or any(w.last.in_flight > w.last.batch_in_flight for w in workers)
        learning = interactive and self._first_report is not None and now - self._first_report < c.baseline_wait_s

        reason = ""
        if not workers:
            reason = "no serving workers"
        elif ttft_p90 is not None and ttft_p90 > ttft_budget:
            reason = f"interactive p90 TTFT {ttft_p90:.3f} s > budget {ttft_budget:.3f} s"
        elif tpot_p90 is not None and tpot_p90 > tpot_budget:
            reason = f"interactive p90 TPOT {tpot_p90 * 1000:.1f} ms > budget {tpot_budget * 1000:.1f} ms"
        elif queue_p90 is not None and queue_p90 > c.pressure_fraction * c.queue_wait_budget_s:
            reason = (f"interactive p90 queue wait {queue_p90:.3f} s > {c.pressure_fraction:g} x budget "
                      f"{c.queue_wait_budget_s:g} s")
        pressure = bool(reason)

        elapsed = 0.0 if self._last_update is None else max(0.0, now - self._last_update)
        self._last_update = now
        if pressure and workers:
            self._last_pressure = now
            if now - self._last_decrease >= c.decrease_every_s:
                self._target *= c.decrease_factor
                self._last_decrease = now
        elif not workers:
            self._target = 0.0  # nothing to feed into (no hold: nothing interactive was hurt)
        elif learning:
            self._target = 0.0
            reason = "learning the interactive-alone baseline"
        elif now - self._last_pressure >= c.hold_after_pressure_s:
            if self._target < c.initial_per_worker * len(workers):
                self._target = min(float(spare), c.initial_per_worker * len(workers))
            self._target = min(float(spare), self._target + c.increase_per_s * len(workers) * elapsed)
            reason = "spare capacity" if self._target < spare else "at the fleet's spare capacity"
        else:
            reason = "holding after pressure"
        if pressured and not pressure:
            reason += f"; {len(pressured)} worker(s) without a share ({pressured[0]})"
        self._target = min(self._target, float(spare))
        self._state = FeedState(target=self._target, spare=spare, pressure=pressure, reason=reason,
                                workers=len(workers), ttft_p90_s=ttft_p90, tpot_p90_s=tpot_p90,
                                queue_wait_p90_s=queue_p90, ttft_budget_s=ttft_budget, tpot_budget_s=tpot_budget,
                                pressured_workers=len(pressured))

    def _learn(self, now: float, ttft_p90: float | None, tpot_p90: float | None) -> None:
        # Exponential smoothing in time (not per call): the baseline averages the light windows
        # of the last ~baseline_tau_s, however often the policy is asked.
        elapsed = self.config.baseline_tau_s if self._last_learn is None else now - self._last_learn
        self._last_learn = now
        a = min(1.0, max(0.0, elapsed) / self.config.baseline_tau_s)
        if ttft_p90 is not None:
            known = self._baseline_ttft
            self._baseline_ttft = ttft_p90 if known is None else (1 - a) * known + a * ttft_p90
        if tpot_p90 is not None:
            known = self._baseline_tpot
            self._baseline_tpot = tpot_p90 if known is None else (1 - a) * known + a * tpot_p90

    def _budget(self, baseline: float | None, slo: float) -> float:
        cap = self.config.pressure_fraction * slo
        return cap if baseline is None else min(cap, (1 + self.config.latency_tolerance) * baseline)

    def _p90(self, counts: list[int], bounds: tuple[float, ...]) -> float | None:
        if sum(counts) < self.config.min_latency_samples:
            return None
        return m.hist_percentile(counts, bounds, 0.9)
