"""Aggregated or disaggregated: the cheaper fleet that holds the SLO, and why.

Both candidates arrive already priced (the aggregated plan's cheapest row, planner.py; the
cheapest prefill × decode pair, disagg.py), each with every GPU it keeps running (serving fleet,
headroom and warm pools). The choice ranks by $/hour, then by GPUs; a tie goes to aggregated (one
pool, no KV link to run). The reason names what decides: for aggregated, the constraint that binds
its replica and, where prefill chunks stall its decode steps, how much slower a chunk step is than a
decode step (what disaggregation removes); for disaggregated, what its pools give up in exchange
(the transfer and the decode steps taken out of the TTFT budget, and the split into two pools).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tools.capacity.plan.disagg import DisaggRow, cheapest
from tools.capacity.plan.planner import Plan, Row

Topology = Literal["aggregated", "disaggregated", "none"]


@dataclass(frozen=True)
class TopologyChoice:
    topology: Topology
    reason: str
    aggregated: Row | None
    disaggregated: DisaggRow | None

    @property
    def gain(self) -> float:
        """Aggregated $/hour ÷ disaggregated $/hour (> 1: disaggregation is cheaper); nan without both."""
        agg, dis = self.aggregated, self.disaggregated
        if agg is None or dis is None or agg.cost is None or dis.usd_per_hour <= 0:
            return math.nan
        return agg.cost.usd_per_hour / dis.usd_per_hour


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _aggregated_terms(row: Row) -> str:
    point = row.point
    text = f"{row.name} binds on {row.binding}"
    if point is not None and point.stable and point.chunk_step_share > 0:
        text += (f" with {point.chunk_step_share:.0%} of its steps carrying a prefill chunk "
                 f"({_ms(point.full_chunk_step_s)} against {_ms(point.decode_only_step_s)} for a decode step)")
    if point is not None and point.stable:
        text += f" and {point.kv_fraction:.0%} of its KV in use"
    return text


def _disaggregated_terms(row: DisaggRow) -> str:
    text = (f"{row.name} at {row.ratio} prefill:decode GPUs: decode binds on {row.decode_binding}")
    if row.decode_point is not None:
        text += (f" at a batch of {row.decode_point.batch:,.0f} ({_ms(row.decode_point.step_s)} steps, "
                 f"{row.decode_point.kv_fraction:.0%} of KV at its p90, reservations included)")
    text += (f"; the prefill keeps {_ms(row.prefill_budget_s)} of the TTFT budget after "
             f"{_ms(row.transfer_p90_s)} of KV transfer over {row.link.name} and {_ms(row.decode_steps_s)} of decode "
             "steps")
    return text


def _fleet(gpus: int, usd_per_hour: float) -> str:
    return f"{gpus:,} GPUs, ${usd_per_hour:,.0f}/hour"


def choose_topology(aggregated: Row | None, disaggregated: DisaggRow | None) -> TopologyChoice:
    """The cheaper of the two feasible fleets (ties: aggregated), with the reason in words."""
    agg = aggregated if aggregated is not None and aggregated.feasible and aggregated.cost is not None else None
    dis = disaggregated if disaggregated is not None and disaggregated.feasible else None
    if agg is None and dis is None:
        return TopologyChoice("none", "neither an aggregated nor a disaggregated fleet holds the SLO", aggregated,
                              disaggregated)
    if dis is None:
        assert agg is not None and agg.cost is not None
        why = (disaggregated.infeasible if disaggregated is not None else "no disaggregated pair was priced")
        return TopologyChoice("aggregated", f"aggregated ({_fleet(agg.gpus_total, agg.cost.usd_per_hour)}): no "
                              f"disaggregated pair holds the SLO ({why})", agg, disaggregated)
    agg_text = None
    if agg is not None:
        assert agg.cost is not None
        agg_text = _fleet(agg.gpus_total, agg.cost.usd_per_hour)
    dis_text = _fleet(dis.gpus_total, dis.usd_per_hour)
    if agg is None:
        why = aggregated.infeasible if aggregated is not None else "no aggregated row was priced"
        return TopologyChoice("disaggregated", f"disaggregated ({dis_text}): no aggregated replica holds the SLO "
                              f"({why}); {_disaggregated_terms(dis)}", aggregated, dis)
    assert agg.cost is not None
    agg_key = (agg.cost.usd_per_hour, agg.gpus_total)
    dis_key = (dis.usd_per_hour, dis.gpus_total)
    if dis_key < agg_key:
        saving = 1 - dis.usd_per_hour / agg.cost.usd_per_hour
        reason = (f"disaggregated ({dis_text}) costs {saving:.0%} less than aggregated ({agg_text}): "
                  f"{_aggregated_terms(agg)}; {_disaggregated_terms(dis)}")
        return TopologyChoice("disaggregated", reason, agg, dis)
    extra = dis.usd_per_hour / agg.cost.usd_per_hour - 1
    if dis_key == agg_key:
        verdict = (f"aggregated ({agg_text}): disaggregated costs the same ({dis_text}), and aggregated runs one pool "
                   "and no KV link")
    else:
        verdict = (f"aggregated ({agg_text}) is cheaper for this mix; disaggregated would cost {extra:.0%} more "
                   f"({dis_text})")
    reason = f"{verdict}: {_aggregated_terms(agg)}; {_disaggregated_terms(dis)}"
    return TopologyChoice("aggregated", reason, agg, dis)


def plan_topology(plan: Plan) -> TopologyChoice:
    """The plan's choice: its cheapest aggregated row against its cheapest disaggregated pair."""
    return choose_topology(plan.cheapest, cheapest(plan.disaggregated))
