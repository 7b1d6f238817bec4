"""One plan row per GPU × TP: goodput (timing model or a measured sweep), replicas, GPUs, dollars, warm pool.

    replicas = ⌈planned rate ÷ per-replica goodput × (1 + headroom)⌉     (PERF_MODEL: 15 % for N+1,
    GPUs     = replicas × TP                                              bursts and imbalance)

Pure: everything the planner reads (mix, sweeps, ramp) arrives already parsed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from services.sim_engine.perf_model import GB, GPUS, PRESETS, RooflineModel

from .costs import Cost, fleet_cost
from .model import Assumptions, Goodput, OperatingPoint, ReplicaModel, Slo, Workload
from .sweep_table import SweepGoodput
from .warm_pool import Ramp, WarmPool, warm_pool


class PlanError(ValueError):
    """Inputs the planner cannot use; the message says which and what is allowed."""


@dataclass(frozen=True)
class PlanInputs:
    rate_rps: float
    rate_text: str  # how the user gave it, e.g. "50,000 requests/min"
    workload: Workload
    mix: Mapping[str, Any]  # Mix.describe()
    slo: Slo
    gpu_prices: Mapping[str, float]  # GPU name → $ per GPU-hour
    tps: Sequence[int]
    preset: str = "latency"
    assumptions: Assumptions = Assumptions()
    headroom: float = 0.15
    cold_start_s: float = 120.0
    warm_start_s: float = 5.0
    ramp: Ramp | None = None

    def __post_init__(self) -> None:
        if not self.rate_rps > 0:
            raise PlanError("the planned rate must be positive")
        if self.headroom < 0:
            raise PlanError("headroom must not be negative")
        unknown = [g for g in self.gpu_prices if g not in GPUS]
        if unknown:
            raise PlanError(f"unknown GPU {', '.join(unknown)}; known: {', '.join(sorted(GPUS))}")
        if any(p < 0 for p in self.gpu_prices.values()):
            raise PlanError("GPU prices must not be negative")
        if self.preset not in PRESETS:
            raise PlanError(f"unknown preset {self.preset!r}; known: {', '.join(sorted(PRESETS))}")
        if self.cold_start_s <= 0 or self.warm_start_s < 0:
            raise PlanError("cold start must be positive and warm start not negative")


@dataclass(frozen=True)
class Row:
    gpu: str
    tp: int
    usd_per_gpu_hour: float
    source: str  # "model" or "sweep"
    kv_capacity_tokens: int
    model_goodput: Goodput  # the timing model's answer, kept even when a sweep replaces it
    goodput_rps: float  # what the plan uses
    binding: str | None
    point: OperatingPoint | None  # the model at goodput_rps (KV use, latencies)
    infeasible: str | None = None
    sweep: SweepGoodput | None = None
    replicas: int = 0
    replicas_exact: float = 0.0
    fleet_point: OperatingPoint | None = None  # the model at the fleet's operating rate (cost split)
    cost: Cost | None = None
    warm: WarmPool | None = None
    curve: tuple[OperatingPoint, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return f"{self.gpu} TP{self.tp}"

    @property
    def feasible(self) -> bool:
        return self.infeasible is None

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    @property
    def gpus_total(self) -> int:
        """Serving GPUs plus the warm pool's."""
        return self.gpus + (self.warm.gpus if self.warm else 0)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    rows: tuple[Row, ...]

    @property
    def cheapest(self) -> Row | None:
        feasible = [r for r in self.rows if r.feasible and r.cost]
        return min(feasible, key=lambda r: (r.cost.usd_per_hour, r.gpus)) if feasible else None  # type: ignore[union-attr]


def _no_kv_reason(model: RooflineModel) -> str:
    usable = model.tp * model.gpu.hbm_bytes * 0.92 / GB
    needed = (model.model.weight_bytes + 4 * GB * model.tp) / GB
    return (f"the model leaves no room for a KV cache: {model.model.weight_bytes / GB:.1f} GB of weights + "
            f"{4 * model.tp} GB reserve = {needed:.1f} GB ≥ {usable:.1f} GB usable HBM "
            f"({model.tp} × {model.gpu.hbm_bytes / GB:.0f} GB × 92%)")


def plan_row(inputs: PlanInputs, gpu: str, tp: int, sweep: SweepGoodput | None = None) -> Row:
    try:
        roofline = RooflineModel(gpu=GPUS[gpu], tp=tp, preset=PRESETS[inputs.preset])
    except ValueError as error:
        raise PlanError(str(error)) from None
    capacity = roofline.kv_capacity_tokens()
    replica = ReplicaModel(roofline, capacity, inputs.workload, inputs.assumptions)
    price = inputs.gpu_prices[gpu]
    model_goodput = replica.goodput(inputs.slo)
    row = partial(Row, gpu=gpu, tp=tp, usd_per_gpu_hour=price, kv_capacity_tokens=capacity,
                  model_goodput=model_goodput, sweep=sweep)
    if capacity <= 0:
        return row(source="model", goodput_rps=0.0, binding=None, point=None, infeasible=_no_kv_reason(roofline))
    warnings: list[str] = []
    if sweep is not None:
        source, rps, binding, reason = "sweep", sweep.rps, sweep.binding, sweep.infeasible
        warnings += sweep.warnings
    else:
        source, rps, binding, reason = "model", model_goodput.rps, model_goodput.binding, model_goodput.infeasible
    if reason or rps <= 0:
        return row(source=source, goodput_rps=0.0, binding=binding, point=model_goodput.point,
                   infeasible=reason or "no goodput", warnings=tuple(warnings))
    point = replica.at(rps) if sweep is not None else model_goodput.point
    if sweep is not None and binding is None:
        binding = "none reached"
    exact = inputs.rate_rps / rps * (1 + inputs.headroom)
    replicas = math.ceil(exact - 1e-9)
    fleet_point = replica.at(inputs.rate_rps / replicas)
    cost = fleet_cost(rate_rps=inputs.rate_rps, workload=inputs.workload, replica_rps=rps, replicas=replicas, tp=tp,
                      usd_per_gpu_hour=price, prefill_share=fleet_point.prefill_share)
    warm = None
    if inputs.ramp is not None:
        warm = warm_pool(ramp_rps_per_s=inputs.ramp.rps_per_s, cold_start_s=inputs.cold_start_s,
                         warm_start_s=inputs.warm_start_s, replica_rps=rps, tp=tp, replicas=replicas,
                         rate_rps=inputs.rate_rps)
        if not warm.covered_by_headroom:
            warnings.append(f"the rise while warm replicas wake ({warm.warm_start_rise_rps:.1f} req/s in "
                            f"{inputs.warm_start_s:g} s) exceeds the fleet's headroom ({warm.headroom_rps:.1f} req/s)")
    if point is not None and point.stable and point.kv_fraction > inputs.assumptions.kv_limit:
        warnings.append(f"the model puts KV use at {point.kv_fraction:.0%} at the measured goodput, over the "
                        f"{inputs.assumptions.kv_limit:.0%} limit")
    curve_to = max(rps, model_goodput.rps if model_goodput.feasible else 0.0) * 1.3
    return row(source=source, goodput_rps=rps, binding=binding, point=point, replicas=replicas, replicas_exact=exact,
               fleet_point=fleet_point, cost=cost, warm=warm, curve=tuple(replica.curve(curve_to)),
               warnings=tuple(warnings))


def make_plan(inputs: PlanInputs, sweeps: Sequence[SweepGoodput] = ()) -> Plan:
    """Every GPU × TP row; a sweep replaces the model's goodput of its row (and adds the row if missing)."""
    by_config: dict[tuple[str, int], SweepGoodput] = {}
    for sweep in sweeps:
        if sweep.gpu not in inputs.gpu_prices:
            raise PlanError(f"{sweep.source} ran on {sweep.gpu}, but --gpu gives no price for {sweep.gpu} "
                            f"(priced: {', '.join(inputs.gpu_prices)})")
        key = (sweep.gpu, sweep.tp)
        if key in by_config:
            raise PlanError(f"two sweeps for {sweep.gpu} TP{sweep.tp}: {by_config[key].source} and {sweep.source}")
        by_config[key] = sweep
    configs = [(gpu, tp) for gpu in inputs.gpu_prices for tp in inputs.tps]
    configs += [key for key in by_config if key not in configs]
    return Plan(inputs, tuple(plan_row(inputs, gpu, tp, by_config.get((gpu, tp))) for gpu, tp in configs))

