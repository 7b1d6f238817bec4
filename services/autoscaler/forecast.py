"""Short-horizon arrival-rate forecast: Holt's linear trend (double exponential smoothing).

Pure: the caller passes the time of each observation. Intervals may be irregular (ticks slip),
so the trend is kept per second and the level is projected over the real gap before blending.
Why Holt and not something richer: the autoscaler only needs "where will the rate be one
cold start from now" on a ramp; seasonality is longer than any horizon it looks at.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HoltForecaster:
    alpha: float = 0.5  # weight of a new observation in the level
    beta: float = 0.2  # weight of a new slope in the trend: low, so noise does not become a ramp
    level: float | None = None
    trend: float = 0.0  # requests per second, per second
    last_t: float | None = None

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"HoltForecaster.{name} must be in (0, 1], got {value}")

    def observe(self, t: float, rate: float) -> None:
        if self.level is None or self.last_t is None:
            self.level, self.last_t = rate, t
            return
        dt = t - self.last_t
        if dt <= 0.0:
            return  # same instant (or clock went back): nothing new to learn
        projected = self.level + self.trend * dt
        level = self.alpha * rate + (1.0 - self.alpha) * projected
        self.trend = self.beta * (level - self.level) / dt + (1.0 - self.beta) * self.trend
        self.level, self.last_t = level, t

    def forecast(self, horizon_s: float) -> float:
        """Expected rate `horizon_s` seconds after the last observation (never negative)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * max(0.0, horizon_s))

    def ramp(self) -> float:
        """The rising part of the trend (req/s per second); a falling trend sizes no warm pool."""
        return max(0.0, self.trend)
