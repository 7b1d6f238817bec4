"""Steady state of one engine replica under Poisson arrivals, and its goodput under an SLO.

Goodput as DistServe defines it (Zhong et al., OSDI 2024): the highest rate whose requests meet the
SLO. Step times from the roofline in inferbus/timing.py. At an
arrival rate of λ requests/s per replica, with o mean output tokens, u mean uncached prompt
tokens, E[u²] their mean square, c_d the time-weighted context of a decoding sequence and c_p the
mean context a prefill token attends to:

    B    = λ · o · t                 decode sequences per step (each stays o steps: Little's law)
    S    = B · c_d                   their resident KV tokens
    f    = λ · u · t / chunk         share of steps that carry a full chunk of prefill
    t_d  = T(B, S, 0, 0)             a decode-only step
    t_f  = T(B, S, chunk, c_p)       a step with a full prefill chunk
    t    = f · t_f + (1 − f) · t_d   the mean step: a fixed point in t
    μ    = chunk / t_f               prefill rate (tokens/s) when a full chunk runs
    ρ    = λ · u / μ,  W_q = λ · E[u²] / μ² / (2 · (1 − ρ))   M/G/1 mean wait (Pollaczek–Khinchine)
    σ    = (t_f − t_d) · √(f · (1 − f) / o)    spread of one request's mean step over its o steps
    TPOT p90 ≈ t + z₉₀ · σ           z₉₀ = 1.2816 (normal approximation)
    TTFT p90 ≈ u₉₀ / μ + ln(10) · W_q + 2 · t    u₉₀: the 90th-percentile uncached prompt
    KV use   = S / capacity ≤ 90 %

With `pool` = c, the router pools c replicas' prefill queues into one (its default policy places
on the least queued prefill work): the wait is M/G/c's instead, and its p90 the tail of that queue
(queueing.py), so TTFT p90 ≈ u₉₀ / μ + W₉₀(c) + 2 · t. Nothing else changes: each replica still
steps its own batch.

Why prefill is priced in whole chunks: the engine prefills a prompt in the steps right after it
arrives (a full chunk while the queue holds one, else everything queued), not spread thinly over
every step. A step with a 2,048-token chunk is compute-bound (its GEMMs outlast the weight read),
a decode step memory-bound, so the step time is convex in prefill tokens: the time of the step
with the *mean* prefill (λ · u · t tokens) is far below the mean of the steps' times. Each of a
request's o steps carries a chunk with probability f, so its TPOT (the mean of its steps) varies
from request to request by σ; the p90 is that spread above the mean.

With speculative decoding each step advances a sequence by E tokens (the step-time model's
`tokens_per_step`), so B = λ · o · t / E, a request lives o / E steps (σ uses o / E) and
TPOT p90 ≈ (t + z₉₀ · σ) / E. With N LoRA adapters spread
evenly over the requests, each step carries a = min(slots, N · (1 − (1 − 1/N)^B)) distinct ones
and pays for them (`inferbus.timing.expected_distinct_adapters`).

Goodput λ_max is the highest λ at which all three hold; each constraint's own limit is found by
bisection (each grows monotonically with λ) and the smallest one binds. "Saturation" (no steady
state: ρ ≥ 1 or the step-time fixed point runs away) is reported too; TTFT and TPOT always bind
before it, and KV binds only if its limit comes before it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from inferbus.timing import StepTimeModel, expected_distinct_adapters
from tools.capacity.mix import Mix
from tools.capacity.plan.queueing import prefill_wait

CONSTRAINTS = ("TTFT", "TPOT", "KV")

# p90 of an exponential wait is ln(10) = 2.30 times its mean ("2.3 × W_q").
P90_WAIT_FACTOR = math.log(10.0)
# The standard normal's 90th percentile: a request's TPOT is a mean over many steps.
Z90 = NormalDist().inv_cdf(0.9)
# A step longer than this is no steady state worth planning for (the queue has run away).
_MAX_STEP_S = 60.0
_FIXED_POINT_ITERATIONS = 200
_BISECTIONS = 50
_MIN_RATE = 1e-6
_MAX_RATE = 1e6


@dataclass(frozen=True)
class Slo:
    ttft_p90_s: float = 0.8
    tpot_p90_s: float = 0.040

    def __post_init__(self) -> None:
        if not (self.ttft_p90_s > 0 and self.tpot_p90_s > 0):
            raise ValueError("SLO targets must be positive")


@dataclass(frozen=True)
class Assumptions:
    """The worked example's modelling constants; every one is a CLI option or derived."""

    chunk_tokens: int = 2048  # chunked-prefill budget per step (the worked example's; the live engine uses 512)
    kv_limit: float = 0.90  # plan to at most this fraction of KV capacity
    tpot_p90_z: float = Z90  # TPOT p90 = mean step + this many spreads of a request's mean step
    wait_p90_factor: float = P90_WAIT_FACTOR
    ttft_steps: float = 2.0  # steps between a request's last prefill chunk and its first token out

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError("chunk must be at least 1 token")
        if not 0 < self.kv_limit <= 1:
            raise ValueError("kv limit must be in (0, 1]")


@dataclass(frozen=True)
class Workload:
    """The per-request moments of a mix the replica model needs (tokens)."""

    input_tokens: float
    output_tokens: float
    cached_tokens: float
    uncached_sq: float  # E[u²]
    decode_ctx_tokens: float  # E[o · (in + o/2)] / E[o]: context of a decoding sequence, time-weighted
    prefill_ctx_tokens: float  # E[u · (cached + in)/2] / E[u]: context a prefill token attends to
    ttft_tokens: float  # uncached prompt the TTFT p90 is quoted for (default: the mix's p90)
    ttft_tokens_derived: bool = True
    # The 90th-percentile whole prompt (the KV a disaggregated prefill sends); None: the mean prompt.
    input_p90_tokens: float | None = None
    # Second moments of a decoding sequence's context (time-weighted) and of a whole prompt: how far
    # a decode replica's KV spreads around its mean (0: not known, the mean alone is planned).
    decode_ctx_sq: float = 0.0
    input_sq: float = 0.0

    @property
    def uncached_tokens(self) -> float:
        return self.input_tokens - self.cached_tokens

    @property
    def transfer_tokens(self) -> float:
        """Prompt tokens whose KV the TTFT p90's request sends from prefill to decode."""
        return self.input_tokens if self.input_p90_tokens is None else self.input_p90_tokens

    @classmethod
    def from_mix(cls, mix: Mix, ttft_tokens: float | None = None) -> Workload:
        stats = mix.stats()
        if stats.output_tokens <= 0 or stats.uncached_tokens <= 0:
            raise ValueError(f"mix {mix.name!r} needs at least one output and one uncached prompt token per request")
        derived = ttft_tokens is None
        return cls(
            input_tokens=stats.input_tokens,
            output_tokens=stats.output_tokens,
            cached_tokens=stats.cached_tokens,
            uncached_sq=stats.uncached_sq,
            decode_ctx_tokens=stats.decode_ctx_tokens,
            prefill_ctx_tokens=stats.prefill_ctx_tokens,
            ttft_tokens=mix.uncached_quantile(0.9) if ttft_tokens is None else float(ttft_tokens),
            ttft_tokens_derived=derived,
            input_p90_tokens=mix.input_quantile(0.9),
            decode_ctx_sq=stats.decode_ctx_sq,
            input_sq=stats.input_sq,
        )


@dataclass(frozen=True)
class OperatingPoint:
    """One replica in steady state at `rate_rps`; latencies are inf when there is no steady state."""

    rate_rps: float
    stable: bool
    step_s: float
    decode_batch: float
    resident_ctx_tokens: float
    prefill_tokens_per_step: float  # λ · u · t: the mean, though prefill runs in whole chunks
    full_chunk_step_s: float
    prefill_rate_tok_s: float  # μ
    prefill_load: float  # ρ
    queue_wait_s: float  # W_q (mean)
    ttft_prefill_s: float  # u₉₀ / μ
    ttft_p90_s: float
    tpot_p90_s: float
    kv_tokens: float
    kv_fraction: float
    decode_only_step_s: float  # the same step without its prefill tokens (for the cost split)
    chunk_step_share: float = 0.0  # f: share of steps carrying a full prefill chunk
    tpot_spread_s: float = 0.0  # σ: standard deviation of one request's mean step
    queue_wait_p90_s: float = math.nan  # W₉₀: ln 10 × W_q for one replica's own queue, else the pool's tail
    queue_waits: float = math.nan  # pooled: C, the chance a prompt waits at all (Erlang C)

    @property
    def prefill_share(self) -> float:
        """Fraction of GPU time that exists because of prefill: what the steps would save without it."""
        if not self.stable or self.step_s <= 0:
            return math.nan
        return max(0.0, (self.step_s - self.decode_only_step_s) / self.step_s)

    def meets(self, constraint: str, slo: Slo, kv_limit: float) -> bool:
        if not self.stable:
            return False
        if constraint == "TTFT":
            return self.ttft_p90_s <= slo.ttft_p90_s
        if constraint == "TPOT":
            return self.tpot_p90_s <= slo.tpot_p90_s
        if constraint == "KV":
            return self.kv_fraction <= kv_limit
        raise ValueError(f"unknown constraint {constraint!r}")


@dataclass(frozen=True)
class Goodput:
    """λ_max of one replica, the constraint that binds there and what each constraint alone allows."""

    rps: float
    binding: str | None
    limits: dict[str, float] = field(default_factory=dict)
    point: OperatingPoint | None = None
    infeasible: str | None = None

    @property
    def feasible(self) -> bool:
        return self.infeasible is None and self.rps > 0


@dataclass(frozen=True)
class ReplicaModel:
    step_model: StepTimeModel
    kv_capacity_tokens: float
    workload: Workload
    assumptions: Assumptions = Assumptions()
    lora_adapters: int = 0  # distinct adapters the traffic spreads over evenly (0: base model only)
    lora_slots: int = 8  # most distinct adapters in one batch (SGLang --max-loras-per-batch)
    # Replicas whose prefill queues the router pools into one (None: each replica its own M/G/1).
    pool: int | None = None
    # Mean steps by rate. The step does not depend on the pool, so the copies `with_pool` makes share
    # it and the pooled fleet's search reuses what it computed; any other copy starts its own.
    steps: dict[float, float | None] = field(default_factory=dict, init=False, compare=False, repr=False)

    def with_pool(self, pool: int | None) -> ReplicaModel:
        """This replica with `pool` replicas' prefill queues pooled (None: its own queue)."""
        copy = replace(self, pool=pool)
        object.__setattr__(copy, "steps", self.steps)
        return copy

    def _batch(self, rate: float, step_s: float) -> float:
        """Decoding sequences at `rate`: each stays o ÷ E steps (Little's law)."""
        return rate * self.workload.output_tokens * step_s / self.step_model.tokens_per_step

    def _adapters(self, batch: float) -> float:
        return expected_distinct_adapters(batch, self.lora_adapters, self.lora_slots)

    # Batch sizes and token counts are steady-state means, so fractional: the step-time model's
    # formula is linear in them and takes floats, whatever its int annotations say.
    def _steps(self, rate: float, step_s: float) -> tuple[float, float, float, float]:
        """At mean step `step_s`: the batch B, the chunk-step share f, and the decode-only and full-chunk steps."""
        w, chunk = self.workload, self.assumptions.chunk_tokens
        batch = self._batch(rate, step_s)
        share = min(rate * w.uncached_tokens * step_s / chunk, 1.0)
        resident, adapters = batch * w.decode_ctx_tokens, self._adapters(batch)
        decode = self.step_model.step_time(batch, resident, 0, 0.0, adapters)  # type: ignore[arg-type]
        full = self.step_model.step_time(batch, resident, chunk, w.prefill_ctx_tokens, adapters)  # type: ignore[arg-type]
        return batch, share, decode, full

    def _step(self, rate: float, step_s: float) -> float:
        _, share, decode, full = self._steps(rate, step_s)
        return share * full + (1 - share) * decode

    def step_at(self, rate: float) -> float | None:
        """The fixed point t = T(B(t), S(t), n_p(t)): the smallest one, or None if none exists."""
        if rate not in self.steps:
            self.steps[rate] = self._fixed_point(rate)
        return self.steps[rate]

    def _fixed_point(self, rate: float) -> float | None:
        low = self.step_model.step_time(0, 0, 0, 0.0)
        # Iterating t ← T(t) from the empty step climbs monotonically to the smallest fixed point
        # (T grows with t); when it crawls (slope near 1) bracket the root and bisect instead.
        for _ in range(_FIXED_POINT_ITERATIONS):
            nxt = self._step(rate, low)
            if nxt > _MAX_STEP_S:
                return None
            if nxt - low <= 1e-12 + 1e-10 * low:
                return nxt
            low = nxt
        high = low * 2
        while self._step(rate, high) > high:
            high *= 2
            if high > _MAX_STEP_S:
                return None
        for _ in range(_BISECTIONS):
            mid = (low + high) / 2
            low, high = (mid, high) if self._step(rate, mid) > mid else (low, mid)
        return high

    def at(self, rate: float) -> OperatingPoint:
        w, a = self.workload, self.assumptions
        step = self.step_at(rate)
        if step is None:  # the step time runs away: no steady state
            inf = math.inf
            return OperatingPoint(
                rate_rps=rate, stable=False, step_s=inf, decode_batch=inf, resident_ctx_tokens=inf,
                prefill_tokens_per_step=a.chunk_tokens, full_chunk_step_s=inf, prefill_rate_tok_s=0.0, prefill_load=inf,
                queue_wait_s=inf, ttft_prefill_s=inf, ttft_p90_s=inf, tpot_p90_s=inf, kv_tokens=inf, kv_fraction=inf,
                decode_only_step_s=inf, queue_wait_p90_s=inf,
            )
        batch, share, decode_only, full = self._steps(rate, step)
        resident = batch * w.decode_ctx_tokens
        prefill = rate * w.uncached_tokens * step
        per_step = self.step_model.tokens_per_step
        # A request's TPOT is the mean of its o ÷ E steps, each a chunk step with probability f.
        spread = (full - decode_only) * math.sqrt(share * (1 - share) * per_step / w.output_tokens)
        mu = a.chunk_tokens / full
        rho = rate * w.uncached_tokens / mu
        stable = rho < 1.0
        waits = math.nan
        if self.pool is None:
            wait = rate * w.uncached_sq / mu**2 / (2 * (1 - rho)) if stable else math.inf
            wait_p90 = a.wait_p90_factor * wait
        else:
            pooled = prefill_wait(rate, w.uncached_tokens / mu, w.uncached_sq / mu**2, self.pool)
            wait, wait_p90, waits = pooled.mean_s, pooled.p90_s, pooled.waits
        ttft_prefill = w.ttft_tokens / mu
        kv_fraction = resident / self.kv_capacity_tokens if self.kv_capacity_tokens > 0 else math.inf
        return OperatingPoint(
            rate_rps=rate, stable=stable, step_s=step, decode_batch=batch, resident_ctx_tokens=resident,
            prefill_tokens_per_step=prefill, full_chunk_step_s=full, prefill_rate_tok_s=mu, prefill_load=rho,
            queue_wait_s=wait, ttft_prefill_s=ttft_prefill, queue_wait_p90_s=wait_p90, queue_waits=waits,
            ttft_p90_s=ttft_prefill + wait_p90 + a.ttft_steps * step if stable else math.inf,
            tpot_p90_s=(step + a.tpot_p90_z * spread) / per_step, kv_tokens=resident, kv_fraction=kv_fraction,
            decode_only_step_s=decode_only, chunk_step_share=share, tpot_spread_s=spread,
        )

    def limit(self, holds: Callable[[OperatingPoint], bool]) -> float:
        """The highest rate at which `holds` is true (0 if not even at a trickle; inf if never false)."""
        if not holds(self.at(_MIN_RATE)):
            return 0.0
        low, high = _MIN_RATE, 1.0
        while holds(self.at(high)):
            low, high = high, high * 2
            if high > _MAX_RATE:
                return math.inf
        for _ in range(_BISECTIONS):
            mid = (low + high) / 2
            low, high = (mid, high) if holds(self.at(mid)) else (low, mid)
        return low

    def goodput(self, slo: Slo) -> Goodput:
        if self.kv_capacity_tokens <= 0:
            return Goodput(0.0, None, infeasible="no KV cache space left next to the weights")
        kv_limit = self.assumptions.kv_limit

        def meeting(constraint: str) -> Callable[[OperatingPoint], bool]:
            return lambda point: point.meets(constraint, slo, kv_limit)

        limits = {c: self.limit(meeting(c)) for c in CONSTRAINTS}
        binding = min(CONSTRAINTS, key=lambda c: limits[c])
        rps = limits[binding]
        limits["saturation"] = self.limit(lambda p: p.stable)
        if rps <= 0:
            idle = self.at(_MIN_RATE)
            reason = {
                "TTFT": f"even an idle replica misses TTFT: p90 {idle.ttft_p90_s * 1e3:,.0f} ms > "
                f"{slo.ttft_p90_s * 1e3:,.0f} ms",
                "TPOT": f"even an idle replica misses TPOT: p90 {idle.tpot_p90_s * 1e3:.1f} ms > "
                f"{slo.tpot_p90_s * 1e3:.1f} ms",
                "KV": "the KV cache cannot hold even one sequence's context",
            }[binding]
            return Goodput(0.0, binding, limits, idle, infeasible=reason)
        if math.isinf(rps):
            raise ValueError("no constraint ever binds: check the step-time model")
        return Goodput(rps, binding, limits, self.at(rps))

    def curve(self, up_to_rps: float, points: int = 40) -> list[OperatingPoint]:
        """Operating points from a trickle to `up_to_rps`, stopping where the steady state ends."""
        out = []
        for i in range(1, points + 1):
            point = self.at(up_to_rps * i / points)
            if not point.stable:
                break
            out.append(point)
        return out
