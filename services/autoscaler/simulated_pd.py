"""The autoscaler's `DisaggregatedPolicy` as the disaggregated fleet simulator's controller
(`tools.capacity.fleetsim.pd.PdFleet`).

Every `interval_s` of virtual time the fleet hands over each pool's `RoleSignals` (what its
workers' load reports would show); this turns them into `PoolSignals`, asks the same
`DisaggregatedPolicy` the service runs (one `AutoscalePolicy` per role, each on its own signal),
and carries each decision out with the fleet's controls (`start`, `promote`, `drain`, `stop_warm`),
as the service's reconciler and actuator do: promote warm replicas up to the serving target, drain
the least loaded beyond it, launch or stop replicas to serving + warm. Duck-typed on purpose:
nothing here imports the simulator.
"""

from __future__ import annotations

from typing import Any

from .policy import Decision, PolicyConfig
from .roles import ROLES, DisaggregatedPolicy, role_pool
from .signals import PoolSignals


def pool_signals(signals: Any, pool: str) -> PoolSignals:
    """`RoleSignals` → `PoolSignals`."""
    return PoolSignals(
        pool=pool, serving=signals.serving, warm=signals.warm, starting=signals.starting, draining=signals.draining,
        slots=signals.slots, arrival_rate=signals.arrival_rate, waiting=signals.waiting,
        in_flight=signals.in_flight, queue_wait_s=signals.queue_wait_s, kv_usage=signals.kv_usage,
        ttft_p90_s=signals.ttft_p90_s, tpot_p90_s=signals.tpot_p90_s,
    )


class PdPolicyController:
    def __init__(self, configs: dict[str, PolicyConfig], pool: str = "sim") -> None:
        self._now = 0.0
        self.pool = pool
        self.policy = DisaggregatedPolicy(lambda: self._now, configs)
        self.decisions: list[Decision] = []

    def decide(self, now: float, signals: dict[str, Any], fleet: Any) -> dict[str, Decision]:
        self._now = now
        out = {}
        for role in ROLES:
            s = signals[role]
            decision = self.policy.decide(role, pool_signals(s, role_pool(self.pool, role)))
            self.decisions.append(decision)
            out[role] = decision
            if decision.desired_serving > s.serving:
                fleet.promote(role, decision.desired_serving - s.serving)
            elif decision.desired_serving < s.serving:
                fleet.drain(role, s.serving - decision.desired_serving)
            launched = s.serving + s.warm + s.starting
            want = decision.desired_serving + decision.desired_warm
            if launched < want:
                fleet.start(role, want - launched)
            elif launched > want and s.warm:
                fleet.stop_warm(role, min(s.warm, launched - want))
        return out
