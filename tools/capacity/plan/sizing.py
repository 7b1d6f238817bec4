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
from dataclasses import dataclass

from tools.capacity.plan.warm_pool import Ramp, WarmPool, warm_pool

FORECAST_ERROR = 0.10  # the busiest minute above the planned peak (an assumption: set it from your forecast)
# The fleet simulator needed up to 2.5% more replicas than the replica model's steady state on the
# two checked mixes (docs/planning.md, "What the headroom is for").
MODEL_ERROR = 0.025
_ROUNDING = 1e-9  # so that an exact whole number of replicas is not rounded up by float noise


@dataclass(frozen=True)
class Replicas:
    count: int
    by_headroom: float  # peak ÷ λ × (1 + headroom) × Z, before rounding up
    by_spare: float  # peak ÷ λ × (1 + forecast error) × (1 + model error), before rounding up and the one spare

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
        return Replicas(count, by_headroom, by_spare)

    def arithmetic(self, goodput_rps: float) -> str:
        """The rule with this fleet's numbers, for the report: max(⌈…⌉, ⌈…⌉ + 1) = N."""
        sized = self.replicas(goodput_rps)
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
