"""A disaggregated fleet's two pools, each sized on its own signal. Pure: injected clock, each
role's `PoolSignals` in, one `Decision` per role out.

A prefill pool and a decode pool serve the same requests but run out of different things, so one
number cannot size both:
  - prefill: its queue and its share of the TTFT budget. Its workers report a decode worker's first
    ask for the prompt to its KV sent as their TTFT (the wait for a decode worker before the ask is
    the decode pool's shortage: services/worker/prefill_timing.py), so the budget is the TTFT SLO less what the decode
    side adds (the plan's prefill budget plus the transfer); a prefill pool's TPOT and KV mean nothing
    for its size (it decodes nothing, and its cache is freed as soon as the KV is sent);
  - decode: TPOT and KV use. A decode pool's queue wait includes waiting for its prefill (the
    decode worker holds the request while the prefill runs), and its TTFT is the client's, most of
    it the prefill pool's: neither says the decode pool is short.
Both see the same arrival rate (every request goes through both), each with its own goodput per
replica from the plan, so the capacity rule sizes them apart too. Each pool is an `AutoscalePolicy`
of its own (own forecaster, cooldowns, scale-down window and warm pool): the same rules as an
aggregated pool, fed its own signals (`PolicyConfig.signals`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from .policy import AutoscalePolicy, Decision, PolicyConfig
from .signals import PoolSignals

ROLES = ("prefill", "decode")
ROLE_SIGNALS: dict[str, tuple[str, ...]] = {"prefill": ("ttft", "queue"), "decode": ("tpot", "kv")}


def role_pool(pool: str, role: str) -> str:
    """The name a role's pool goes by in decisions, metrics and logs."""
    return f"{pool}:{role}"


@dataclass(frozen=True)
class RoleBounds:
    """What the plan gives one pool: its goodput per replica and its replica bounds."""

    goodput_rps: float
    max_serving: int
    max_warm: int
    max_replicas: int
    min_serving: int | None = None  # None: the shared config's
    goodput_by_serving: tuple[tuple[int, float], ...] = ()  # PolicyConfig.goodput_by_serving


def role_configs(base: PolicyConfig, *, prefill: RoleBounds, decode: RoleBounds, prefill_ttft_budget_s: float,
                 decode_kv_budget: float) -> dict[str, PolicyConfig]:
    """The two pools' policy configs: the shared rules of `base` (SLO, headroom, windows, cold
    start), each pool's goodput and bounds, and the signals it is sized on."""
    if prefill_ttft_budget_s <= 0:
        raise ValueError(f"the prefill pool's TTFT budget must be > 0, got {prefill_ttft_budget_s}")

    def bounded(b: RoleBounds, **kwargs: object) -> PolicyConfig:
        return dataclasses.replace(base, goodput_rps=b.goodput_rps, goodput_by_serving=b.goodput_by_serving,
                                   max_serving=b.max_serving,
                                   min_serving=base.min_serving if b.min_serving is None else b.min_serving,
                                   min_warm=min(base.min_warm, b.max_warm), max_warm=b.max_warm,
                                   max_replicas=b.max_replicas, **kwargs)  # type: ignore[arg-type]

    return {
        "prefill": bounded(prefill, signals=ROLE_SIGNALS["prefill"], ttft_slo_s=prefill_ttft_budget_s),
        "decode": bounded(decode, signals=ROLE_SIGNALS["decode"], kv_budget=decode_kv_budget),
    }


@dataclass
class DisaggregatedPolicy:
    """Decides the prefill and decode pools of one model apart. The service and the fleet
    simulator both hand it each role's signals on every tick."""

    clock: Callable[[], float]
    configs: dict[str, PolicyConfig]
    _policies: dict[str, AutoscalePolicy] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if set(self.configs) != set(ROLES):
            raise ValueError(f"need a config for each of {', '.join(ROLES)}, got {sorted(self.configs)}")
        self._policies = {role: AutoscalePolicy(self.clock, self.configs[role]) for role in ROLES}

    def policy(self, role: str) -> AutoscalePolicy:
        return self._policies[role]

    def decide(self, role: str, signals: PoolSignals) -> Decision:
        """One pool's decision; `signals` are that role's workers' only."""
        return self._policies[role].decide(signals)

    def decide_both(self, prefill: PoolSignals, decode: PoolSignals) -> dict[str, Decision]:
        return {"prefill": self.decide("prefill", prefill), "decode": self.decide("decode", decode)}
