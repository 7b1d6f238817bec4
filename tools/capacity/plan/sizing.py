"""How many replicas a fleet needs from one replica's goodput λ: one rule for the aggregated rows and
for each pool of a disaggregated pair.

    N = max(⌈peak ÷ λ × (1 + headroom) × Z⌉,  ⌈peak ÷ λ × (1 + forecast error) × (1 + model error)⌉ + 1)

The first term is the headroom (and, with Z > 1 zones, the zone factor Z ÷ (Z − 1)): in a fleet of
hundreds of replicas the default 15% covers the three things docs/planning.md lists at once. The
second is those same three things spelled out for a small fleet: with one replica down (N + 1), the
others still serve the busiest minute, which comes in `forecast_error` above the planned peak, plus
the model's own error. In a fleet of a few replicas one replica is a third or half of it, which
the headroom alone does not cover; the second term then binds. The two meet at about 45 replicas
with the defaults (15% against 12.75% + one replica).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from tools.capacity.plan.warm_pool import Ramp, WarmPool, warm_pool

FORECAST_ERROR = 0.10  # the busiest minute above the planned peak (an assumption: set it from your forecast)
# The fleet simulator needed up to 2.5% more replicas than the replica model's steady state on the
# two checked mixes (docs/planning.md, "What the headroom is for").
MODEL_ERROR = 0.025
# With the prefill queues pooled (--prefill-queue pooled) the replica model errs the other way: its
# steady state leaves out how far a busy minute's p90 runs above the run's. Checked behind the
# router's affinity policy at 10 to 80 req/s on both mixes of `python -m bench.pd`
# (bench/README.md), 16% on the pooled TTFT limit is the error at which every pooled plan held
# (with 10% the long-prompt plan at 40 req/s and the conversation one at 80 came out short).
POOLED_MODEL_ERROR = 0.16
# Fewer serving replicas than this were not found to pool: with 3 the conversation plan at 5 req/s
# missed (affinity keeps a conversation on its replica, so three queues are not one).
POOLED_FROM_REPLICAS = 4
_ROUNDING = 1e-9  # so that an exact whole number of replicas is not rounded up by float noise
# Pool sizes the autoscaler is given a pooled goodput at are about this far apart.
POOL_SIZE_STEP = 1.25


def pool_sizes(replicas: int) -> list[int]:
    """Serving sizes a pooled fleet of up to `replicas` gives the autoscaler its goodput at: 1 (fewer
    than POOLED_FROM_REPLICAS do not pool: each replica's own queue), then from POOLED_FROM_REPLICAS
    up to `replicas` about POOL_SIZE_STEP apart. Between two sizes the autoscaler takes the smaller
    one's goodput, which only errs towards more replicas."""
    sizes, n = [1], POOLED_FROM_REPLICAS
    while n < replicas:
        sizes.append(n)
        n = max(n + 1, round(n * POOL_SIZE_STEP))
    return sizes + [replicas] if replicas >= POOLED_FROM_REPLICAS else sizes


@dataclass(frozen=True)
class PooledGoodputs:
    """One replica's goodput by the number of replicas serving, in a fleet (or pool) of up to
    `replicas` whose prefill queues the router pools: the autoscaler's capacity table. Computed
    when asked (each size is a bisection; a plan needs it for the row it deploys only)."""

    goodput_at: Callable[[int], float]  # pool size → one replica's goodput
    alone: float  # each replica its own queue (fewer than POOLED_FROM_REPLICAS)
    replicas: int

    def table(self) -> tuple[tuple[int, float], ...]:
        """(serving replicas, goodput per replica) at `pool_sizes`; a size whose goodput equals the
        one before says nothing new (the TPOT or KV limit binds there) and is left out."""
        entries: list[tuple[int, float]] = []
        for n in pool_sizes(self.replicas):
            goodput = self.alone if n < POOLED_FROM_REPLICAS else self.goodput_at(n)
            if not entries or goodput != entries[-1][1]:
                entries.append((n, goodput))
        return tuple(entries)


@dataclass(frozen=True)
class Replicas:
    count: int
    by_headroom: float  # peak ÷ λ × (1 + headroom) × Z, before rounding up
    by_spare: float  # peak ÷ λ × (1 + forecast error) × (1 + model error), before rounding up and the one spare
    model_error: float = MODEL_ERROR  # the one the spare term used
    goodput_rps: float = math.nan  # the per-replica rate it was sized at

    @property
    def binding(self) -> str:
        """Which term set the count: "headroom" or "N+1"."""
        return "headroom" if math.ceil(self.by_headroom - _ROUNDING) >= self.count else "N+1"


@dataclass(frozen=True)
class FleetTerms:
    """What sizes a fleet from per-replica goodputs: the rate, headroom, spare, zones and ramp."""

    rate_rps: float
    headroom: float
    zone_factor: float
    forecast_error: float = FORECAST_ERROR
    model_error: float = MODEL_ERROR
    ramp: Ramp | None = None
    cold_start_s: float = 120.0
    warm_start_s: float = 5.0

    @property
    def surge(self) -> float:
        """(1 + forecast error) × (1 + model error): what one replica fewer must still serve, over the peak."""
        return (1 + self.forecast_error) * (1 + self.model_error)

    def replicas(self, goodput_rps: float) -> Replicas:
        need = self.rate_rps / goodput_rps
        by_headroom = need * (1 + self.headroom) * self.zone_factor
        by_spare = need * self.surge
        count = max(math.ceil(by_headroom - _ROUNDING), math.ceil(by_spare - _ROUNDING) + 1)
        return Replicas(count, by_headroom, by_spare, self.model_error, goodput_rps)

    def serving(self, replicas: int) -> int:
        """The replicas of a fleet of `replicas` still serving at its worst: one down, or across zones
        one zone down (at least one)."""
        left = replicas - 1 if self.zone_factor == 1 else math.floor(replicas / self.zone_factor + _ROUNDING)
        return max(1, min(replicas - 1, left))

    def pooled(self, sized_at: Callable[[int], Replicas]) -> tuple[Replicas, int]:
        """Replicas when one replica's goodput grows with the pool of replicas whose prefill queues
        the router pools: `sized_at(c)` sizes the fleet with the goodput of c pooled replicas (its
        count never grows with c). The fleet is the smallest N that `sized_at` sizes at most N with
        the pool it keeps at its worst, c = `serving(N)`. Returns that sizing, at N, and c."""
        high = sized_at(1).count  # the smallest pool's goodput sizes the most
        low = 1
        while low < high:
            mid = (low + high) // 2
            if sized_at(self.serving(mid)).count <= mid:
                high = mid
            else:
                low = mid + 1
        pool = self.serving(low)
        at = sized_at(pool)
        return replace(at, count=max(low, at.count)), pool

    def arithmetic(self, goodput_rps: float, sized: Replicas | None = None) -> str:
        """The rule with this fleet's numbers, for the report: max(⌈…⌉, ⌈…⌉ + 1) = N (`sized`: as a
        pooled fleet was sized, with its own model error and count)."""
        if sized is not None and sized.model_error != self.model_error:
            return replace(self, model_error=sized.model_error).arithmetic(goodput_rps, sized)
        if sized is not None and not math.isnan(sized.goodput_rps):
            goodput_rps = sized.goodput_rps
        sized = sized or self.replicas(goodput_rps)
        rate, lam = f"{self.rate_rps:,.2f}", f"{goodput_rps:,.3f}"
        zones = f" × {self.zone_factor:.3g}" if self.zone_factor != 1 else ""
        return (f"max(⌈{rate} ÷ {lam} × {1 + self.headroom:g}{zones}⌉, "
                f"⌈{rate} ÷ {lam} × {1 + self.forecast_error:g} × {1 + self.model_error:g}⌉ + 1) = "
                f"max(⌈{sized.by_headroom:,.2f}⌉, ⌈{sized.by_spare:,.2f}⌉ + 1) = {sized.count:,}")

    def warm(self, goodput_rps: float, tp: int, replicas: int) -> WarmPool | None:
        if self.ramp is None:
            return None
        return warm_pool(ramp_rps_per_s=self.ramp.rps_per_s, cold_start_s=self.cold_start_s,
                         warm_start_s=self.warm_start_s, replica_rps=goodput_rps, tp=tp, replicas=replicas,
                         rate_rps=self.rate_rps)
