"""How many replicas a pool should serve with, and how many to keep warm. Pure: injected clock,
a `PoolSignals` snapshot in, a `Decision` out; state is only what stabilisation and the forecast
must remember between ticks. The fleet simulator drives this same object.

Rules, in the order they can raise the serving target:
  1. SLO pressure. pressure = max(p90 TTFT / SLO, p90 TPOT / SLO, queue wait / budget) over the
     signals the pool is sized on (`PolicyConfig.signals`: all three for an aggregated pool; a
     disaggregated fleet's prefill pool reads TTFT and queue, its decode pool TPOT and KV use ÷ its
     budget, roles.py). Above 1,
     the serving target grows in proportion (×pressure, at least +1, at most ×max_step_up),
     then holds for `slo_cooldown_s`: windowed percentiles still show the breach for a while
     after the fix, and must not be counted twice. Not GPU utilisation: a full GPU is the goal;
     requests burning their TTFT in the queue are the problem.
  2. Capacity. replicas = ceil(rate × (1 + headroom) / goodput per replica), with the rate the
     larger of now and the forecast one warm start ahead: what promotion can still fix in time.
     Where the router pools the replicas' prefill queues, one replica's goodput grows with the
     replicas serving (a prompt waits for the first free one of n, M/G/n): the plan's goodputs by
     pool size (`goodput_by_serving`) then give the fewest n whose n × goodput(n) covers it.
  3. In-flight work and the minimum: never fewer serving replicas than the interactive requests
     held need slots, nor fewer than `min_serving`.
The warm pool holds what the forecast needs one cold start ahead beyond the serving target, and
at least the observed ramp × cold start ÷ goodput: a ramp is met by promotion (seconds) while
the warm pool refills by cold start (minutes). Scale-down is slow: a target is lowered only to
the highest recommendation of the last `scale_down_window_s` (sustained low load), by at most
`max_step_down` of the fleet per step, and never while pressure is above `down_pressure`.
Batch-band load raises nothing: it is filler, preempted when interactive load needs the room.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from .forecast import HoltForecaster
from .signals import PoolSignals

Direction = Literal["up", "down", "hold"]
SIGNALS = ("ttft", "tpot", "queue", "kv")


@dataclass(frozen=True)
class PolicyConfig:
    ttft_slo_s: float = 0.8  # p90, DESIGN.md
    tpot_slo_s: float = 0.04  # p90
    queue_wait_budget_s: float = 0.5  # p90 wait before an engine starts a request (part of TTFT)
    goodput_rps: float = (
        4.1  # interactive req/s one replica serves within the SLO (H100 TP2, worked-example mix, mean-prefill estimate)
    )
    # (serving replicas, goodput per replica) from the plan, sizes ascending: n serving replicas
    # serve at the goodput of the largest size ≤ n (the first below it). Empty: goodput_rps at every size.
    goodput_by_serving: tuple[tuple[int, float], ...] = ()
    headroom: float = 0.15  # N+1, bursts and imbalance (the capacity plan's 15%)
    slots_per_replica: int = 256  # engine max_running_requests, for the in-flight floor when none report
    min_serving: int = 1
    max_serving: int = 64
    min_warm: int = 0
    max_warm: int = 8
    max_replicas: int = 72  # serving + warm + starting: the GPU budget
    cold_start_s: float = 120.0  # launch → warm (weights load, graph capture)
    warm_start_s: float = 5.0  # promote → serving
    max_step_up: float = 2.0  # one SLO-driven step at most doubles the serving target
    slo_cooldown_s: float = 15.0  # after an SLO-driven step, before the next one
    scale_down_window_s: float = 300.0  # sustained low load before a target is lowered
    max_step_down: float = 0.1  # share of the serving replicas removed per step (at least 1)
    down_step_s: float = 30.0  # between two scale-down steps
    # No scale-down while any SLO signal is above this share of its budget. Not lower: at the
    # planner's goodput (TPOT-bound) p90 TPOT runs at 85-95 % of its SLO, and a lower gate would
    # never let the fleet shrink to what the capacity rule asks for.
    down_pressure: float = 0.9
    forecast_alpha: float = 0.5
    forecast_beta: float = 0.2
    # The warm pool covers the largest shortfall of a serving target against demand one cold start
    # later seen this long back: bursts recur, and a cold start is too slow for them. 0: off (the
    # default until the service has a setting for it; bench/autoscale.py runs with 3600 s).
    burst_memory_s: float = 0.0
    # The signals SLO pressure reads (SIGNALS): an aggregated pool all of its latencies; the pools
    # of a disaggregated fleet each their own (roles.py).
    signals: tuple[str, ...] = ("ttft", "tpot", "queue")
    kv_budget: float = 0.9  # with "kv" in signals: KV use above this share of the cache is pressure

    def __post_init__(self) -> None:
        if not self.signals or set(self.signals) - set(SIGNALS):
            raise ValueError(f"signals must be some of {', '.join(SIGNALS)}, got {self.signals}")
        if not 0 < self.kv_budget <= 1:
            raise ValueError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        positive = ("ttft_slo_s", "tpot_slo_s", "queue_wait_budget_s", "goodput_rps", "cold_start_s",
                    "scale_down_window_s", "down_step_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("headroom", "warm_start_s", "slo_cooldown_s", "burst_memory_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_serving <= self.max_serving or self.max_serving < 1:
            raise ValueError(f"need 0 <= min_serving <= max_serving and max_serving >= 1, got "
                             f"{self.min_serving}..{self.max_serving}")
        if not 0 <= self.min_warm <= self.max_warm:
            raise ValueError(f"need 0 <= min_warm <= max_warm, got {self.min_warm}..{self.max_warm}")
        if self.max_replicas < self.max_serving:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= max_serving ({self.max_serving})")
        if self.max_step_up < 1:
            raise ValueError(f"max_step_up must be >= 1, got {self.max_step_up}")
        if not 0 < self.max_step_down <= 1:
            raise ValueError(f"max_step_down must be in (0, 1], got {self.max_step_down}")
        if not 0 < self.down_pressure <= 1:
            raise ValueError(f"down_pressure must be in (0, 1], got {self.down_pressure}")
        if self.slots_per_replica < 1:
            raise ValueError(f"slots_per_replica must be >= 1, got {self.slots_per_replica}")
        sizes = [n for n, _ in self.goodput_by_serving]
        if sizes != sorted(set(sizes)) or any(n < 1 or g <= 0 for n, g in self.goodput_by_serving):
            raise ValueError(f"goodput_by_serving must be ascending sizes >= 1 with goodputs > 0, "
                             f"got {self.goodput_by_serving}")

    def goodput_at(self, serving: int) -> float:
        """One replica's goodput when `serving` replicas serve."""
        goodput = self.goodput_by_serving[0][1] if self.goodput_by_serving else self.goodput_rps
        for n, g in self.goodput_by_serving:
            if n > serving:
                break
            goodput = g
        return goodput

    def serving_for(self, rate: float) -> int:
        """The fewest serving replicas whose goodput covers `rate` with the headroom."""
        need = max(0.0, rate) * (1.0 + self.headroom)
        if not self.goodput_by_serving:
            return math.ceil(need / self.goodput_rps - 1e-9)
        # n × goodput(n) only grows with n: the first size range holding an n that covers it has the fewest.
        bounds = [n for n, _ in self.goodput_by_serving[1:]] + [math.inf]
        for (first, goodput), end in zip(self.goodput_by_serving, bounds, strict=True):
            n = max(first if need > 0 else 0, math.ceil(need / goodput - 1e-9))
            if n < end:
                return n
        raise AssertionError("the last size range is unbounded")


def parse_goodputs(text: str) -> tuple[tuple[int, float], ...]:
    """`goodput_by_serving` from its setting: "1:2.1,4:2.6,8:2.8" (serving replicas:req/s each)."""
    entries = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        size, sep, goodput = item.partition(":")
        try:
            entries.append((int(size), float(goodput)))
        except ValueError:
            raise ValueError(f"goodput_by_serving: expected serving replicas:req/s, got {item!r}") from None
        if not sep:
            raise ValueError(f"goodput_by_serving: expected serving replicas:req/s, got {item!r}")
    return tuple(entries)


@dataclass(frozen=True)
class Decision:
    pool: str
    at: float
    direction: Direction
    serving: int  # now
    warm: int
    starting: int
    desired_serving: int
    desired_warm: int
    reason: str
    causes: tuple[str, ...]  # what set the target: slo, capacity, forecast, inflight, min, max, window
    pressure: float  # max of the SLO ratios (1 = at the SLO)
    forecast_rate: float  # req/s one warm start ahead
    capacity_rate: float  # what desired_serving replicas serve at the configured goodput, headroom kept


@dataclass
class _PoolState:
    forecaster: HoltForecaster
    started: float
    slo_target: int = 0  # the last SLO-driven serving target, held through the cooldown
    slo_at: float = -math.inf
    pending_since: float | None = None  # since when fewer serve than the last target ordered
    reached_at: float = -math.inf  # when they last all served
    raised_at: float = -math.inf  # when the serving target last went up
    targets: deque[tuple[float, int]] = field(default_factory=deque)  # (t, serving target), one cold start back
    bursts: deque[tuple[float, float]] = field(default_factory=deque)  # (t, need ÷ target a cold start before)
    last_down: float = -math.inf
    history: deque[tuple[float, int, int]] = field(default_factory=deque)  # (t, serving rec, warm rec)
    last_serving_target: int | None = None
    last_warm_target: int | None = None


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


@dataclass
class AutoscalePolicy:
    clock: Callable[[], float]
    config: PolicyConfig = field(default_factory=PolicyConfig)
    _pools: dict[str, _PoolState] = field(default_factory=dict)

    def replicas_for(self, rate: float) -> int:
        """Replicas added for `rate` more (a ramp): at the goodput of the pool as the plan sized it."""
        return math.ceil(max(0.0, rate) * (1.0 + self.config.headroom) / self.config.goodput_rps - 1e-9)

    def _state(self, pool: str, now: float) -> _PoolState:
        state = self._pools.get(pool)
        if state is None:
            c = self.config
            state = self._pools[pool] = _PoolState(HoltForecaster(c.forecast_alpha, c.forecast_beta), started=now)
        return state

    def _burst(self, state: _PoolState, now: float, need: int) -> float:
        """How far demand outgrew the serving target of one cold start earlier, at most, over the
        last `burst_memory_s` (a ratio, 1 = never). A cold-started replica ordered when the rise
        began comes too late for it; the warm pool must absorb such a rise by promotion, and it is
        remembered because bursts recur (a day's hour boundaries, a scheduled job)."""
        c = self.config
        if c.burst_memory_s <= 0:
            return 1.0
        targets, bursts = state.targets, state.bursts
        while targets and now - targets[0][0] > c.cold_start_s:
            targets.popleft()
        base = min((d for _, d in targets), default=0)
        ratio = need / base if base else 1.0
        while bursts and bursts[-1][1] <= ratio:  # monotonic: the front is the memory's largest
            bursts.pop()
        bursts.append((now, ratio))
        while now - bursts[0][0] > c.burst_memory_s:
            bursts.popleft()
        return max(1.0, bursts[0][1])

    def pressure(self, s: PoolSignals) -> tuple[float, list[str]]:
        """The worst SLO ratio, and the breaches in words."""
        c = self.config
        ratios = [0.0]
        breaches = []
        # (signal, value, budget, breach text): in the order the reason names them.
        checks = (
            ("ttft", s.ttft_p90_s, c.ttft_slo_s, lambda v, b: f"p90 TTFT {_ms(v)} > {_ms(b)}"),
            ("tpot", s.tpot_p90_s, c.tpot_slo_s, lambda v, b: f"p90 TPOT {_ms(v)} > {_ms(b)}"),
            ("queue", s.queue_wait_s, c.queue_wait_budget_s, lambda v, b: f"queue wait {v:.2f} s > {b:.2f} s"),
            ("kv", s.kv_usage, c.kv_budget, lambda v, b: f"KV {v:.0%} > {b:.0%}"),
        )
        for name, value, budget, text in checks:
            if name not in c.signals or value is None:
                continue
            ratios.append(value / budget)
            if value > budget:
                breaches.append(text(value, budget))
        return max(ratios), breaches

    def decide(self, s: PoolSignals) -> Decision:
        c = self.config
        now = self.clock()
        state = self._state(s.pool, now)
        state.forecaster.observe(now, s.arrival_rate)
        soon = max(s.arrival_rate, state.forecaster.forecast(c.warm_start_s))
        later = max(s.arrival_rate, state.forecaster.forecast(c.cold_start_s))
        pressure, breaches = self.pressure(s)
        current = s.serving
        causes: list[str] = []

        # --- serving: every rule's floor, then stabilisation --------------------------------
        capacity = c.serving_for(soon)
        slots = s.slots / s.serving if s.serving and s.slots else c.slots_per_replica
        inflight = math.ceil(s.in_flight / slots) if s.in_flight else 0
        slo = 0
        # The windowed signals lag the fix: pressure adds a step only `slo_cooldown_s` after the
        # replicas already ordered all serve (while a cold start runs the backlog, and the
        # pressure, keep growing; counting them again would overshoot), or once the last of
        # them is overdue (a cold start + the cooldown after the target last went up).
        ordered = state.last_serving_target if state.last_serving_target is not None else current
        if current >= ordered:
            if state.pending_since is not None:
                state.pending_since, state.reached_at = None, now
        elif state.pending_since is None:
            state.pending_since = now
        settled = state.pending_since is None and now - state.reached_at >= c.slo_cooldown_s
        overdue = state.pending_since is not None and now - state.raised_at >= c.cold_start_s + c.slo_cooldown_s
        if pressure > 1.0:
            if now - state.slo_at >= c.slo_cooldown_s and (settled or overdue):
                base = max(current, 1)
                step = min(math.ceil(base * pressure), math.floor(base * c.max_step_up))
                state.slo_target, state.slo_at = max(current + 1, step), now
            if now - state.slo_at < c.cold_start_s + c.slo_cooldown_s:
                slo = state.slo_target  # the last step still in effect: hold it, do not stack another
        recommended = max(capacity, inflight, c.min_serving, slo)
        target_cap = min(c.max_serving, c.max_replicas)

        # Warm pool: forecast one cold start ahead beyond what serves, and the ramp over a cold start.
        ramp_replicas = self.replicas_for(state.forecaster.ramp() * c.cold_start_s)
        burst = self._burst(state, now, c.serving_for(state.forecaster.level or 0.0))
        burst_replicas = math.ceil(min(recommended, target_cap) * (burst - 1.0) - 1e-9)
        warm_rec = max(
            c.min_warm, ramp_replicas, burst_replicas, c.serving_for(later) - min(recommended, target_cap)
        )
        state.history.append((now, recommended, warm_rec))
        while state.history and now - state.history[0][0] > c.scale_down_window_s:
            state.history.popleft()
        window_serving = max(r for _, r, _ in state.history)
        window_warm = max(w for _, _, w in state.history)
        full_window = now - state.started >= c.scale_down_window_s

        before = state.last_serving_target if state.last_serving_target is not None else current
        if recommended > before:
            desired = recommended
            causes += [name for name, value in (("slo", slo), ("capacity", capacity), ("inflight", inflight),
                                                ("min", c.min_serving)) if value == recommended]
        elif recommended < before:
            desired = before
            if (full_window and pressure <= c.down_pressure and now - state.last_down >= c.down_step_s
                    and window_serving < before):
                desired = max(window_serving, before - max(1, math.floor(before * c.max_step_down)))
                state.last_down = now
                causes.append("window")
        else:
            desired = before
        if desired > target_cap:
            desired = target_cap
            causes.append("max")

        # Warm: grows at once, shrinks only to the window's highest need (cold starts are dear).
        previous_warm = state.last_warm_target if state.last_warm_target is not None else s.warm + s.starting
        if warm_rec >= previous_warm:
            warm = warm_rec
        else:
            warm = min(previous_warm, window_warm) if full_window else previous_warm
        warm = min(max(c.min_warm, min(c.max_warm, warm)), c.max_replicas - desired)  # the GPU budget wins
        # Direction against the previous target, so a scale-up is announced once, not on every
        # tick until its replicas serve.
        if desired > before:
            state.raised_at = now
        state.last_serving_target, state.last_warm_target = desired, warm
        state.targets.append((now, desired))
        direction: Direction = "up" if desired > before else "down" if desired < before else "hold"
        capped = recommended > desired
        warm_note = ""
        if burst_replicas and warm:
            warm_note = (f" (demand outgrew the serving target of a cold start before by up to {burst - 1:.0%} "
                         f"in the last {c.burst_memory_s:g} s: {burst_replicas} replicas)")
        reason = self._reason(s, direction, before, desired, warm, breaches, soon, capacity, inflight, pressure, capped,
                              warm_note)
        return Decision(
            pool=s.pool, at=now, direction=direction, serving=current, warm=s.warm, starting=s.starting,
            desired_serving=desired, desired_warm=warm, reason=reason, causes=tuple(causes), pressure=pressure,
            forecast_rate=soon, capacity_rate=desired * c.goodput_at(desired) / (1.0 + c.headroom),
        )

    def _reason(self, s: PoolSignals, direction: Direction, before: int, desired: int, warm: int, breaches: list[str],
                rate: float, capacity: int, inflight: int, pressure: float, capped: bool, warm_note: str = "") -> str:
        c = self.config
        demand = (f"{s.arrival_rate:.1f} req/s (forecast {rate:.1f}) needs {capacity} at "
                  f"{c.goodput_at(capacity):.3g} req/s each +{c.headroom:.0%}")
        facts = [f"p90 TTFT {_ms(s.ttft_p90_s)}", f"p90 TPOT {_ms(s.tpot_p90_s)}",
                 f"queue wait {s.queue_wait_s:.2f} s", f"KV {s.kv_usage:.0%}"]
        if s.batch_in_flight:
            facts.append(f"batch in flight {s.batch_in_flight} (filler, not scaled for)")
        pool = f"serving {s.serving}, warm {s.warm}→{warm}{warm_note}" + (
            f", starting {s.starting}" if s.starting else ""
        )
        if direction == "up":
            why = breaches + ([demand] if capacity >= desired else []) + (
                [f"{s.in_flight} requests in flight need {inflight}"] if inflight >= desired else [])
            if not why:
                why = [f"minimum {c.min_serving}"]
            head = f"scale up {before}→{desired}: " + ", ".join(why)
        elif direction == "down":
            head = (f"scale down {before}→{desired}: low load for {c.scale_down_window_s:g} s, {demand}, "
                    f"pressure {pressure:.2f} ≤ {c.down_pressure:g}")
        elif capped:
            head = f"hold {desired}: at the maximum {min(c.max_serving, c.max_replicas)}, " + ", ".join(
                breaches + [demand]
            )
        else:
            head = f"hold {desired}: " + (
                ", ".join(breaches) + " (already scaled for it; cooling down while new replicas take load)"
                if breaches
                else demand
            )
        if capped and direction == "up":
            head += f" (capped at {min(c.max_serving, c.max_replicas)})"
        return f"{head}; {', '.join(facts)}; {pool}"


# ---- from a decision to actions ---------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    replicas: int  # replicas the actuator should run: serving + warm + starting
    promote: tuple[str, ...] = ()  # warm → serving
    demote: tuple[str, ...] = ()  # serving → warm (drain, keep the engine)
    retire: tuple[str, ...] = ()  # warm replicas to stop


@dataclass
class Reconciler:
    """Turns a decision into promotions, demotions and a replica count. Pure, injected clock.

    Commands travel over core NATS and take effect a few seconds later; until a worker's reports
    show the new phase (or `pending_s` passes) it is counted as already changed, so one decision is
    not acted on twice.
    """

    clock: Callable[[], float]
    pending_s: float = 30.0
    _promoted: dict[str, float] = field(default_factory=dict)
    _demoted: dict[str, float] = field(default_factory=dict)

    def plan(self, decision: Decision, signals: PoolSignals, launched: int) -> Plan:
        now = self.clock()
        serving_ids, warm_ids = list(signals.serving_ids), list(signals.warm_ids)
        for pending, still in ((self._promoted, warm_ids), (self._demoted, serving_ids)):
            for worker_id, at in list(pending.items()):
                if worker_id not in still or now - at > self.pending_s:
                    del pending[worker_id]
        serving = [w for w in serving_ids if w not in self._demoted] + [w for w in warm_ids if w in self._promoted]
        warm = [w for w in warm_ids if w not in self._promoted]
        promote: list[str] = []
        demote: list[str] = []
        if decision.desired_serving > len(serving):
            promote = warm[: decision.desired_serving - len(serving)]
            warm = warm[len(promote):]
        elif decision.desired_serving < len(serving):
            # Least loaded first (signals order them so): they finish soonest.
            demote = [w for w in serving_ids if w not in self._demoted][: len(serving) - decision.desired_serving]
        for worker_id in promote:
            self._promoted[worker_id] = now
        for worker_id in demote:
            self._demoted[worker_id] = now
        want = decision.desired_serving + decision.desired_warm
        retire: list[str] = []
        if launched > want:
            # Only idle warm replicas are stopped; serving ones are demoted first and retired once warm.
            retire = warm[: launched - want]
        replicas = max(want, launched - len(retire)) if launched > want else want
        return Plan(replicas=replicas, promote=tuple(promote), demote=tuple(demote), retire=tuple(retire))
