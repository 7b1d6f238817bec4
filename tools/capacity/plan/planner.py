"""One plan row per GPU × TP: goodput (timing model or a measured sweep), replicas, GPUs, dollars, warm pool.

    replicas = max(⌈planned rate ÷ per-replica goodput × (1 + headroom) × Z ÷ (Z − 1)⌉,
                   ⌈planned rate ÷ per-replica goodput × (1 + forecast error) × (1 + model error)⌉ + 1)
               (default 15 % headroom: forecast error, N+1 and the model's error, docs/planning.md; with Z > 1 zones the
               fleet still serves the peak with one zone lost; the second term binds in a fleet of a few replicas,
               sizing.py)
    GPUs     = (replicas + warm pool) × TP: every GPU the plan keeps running is priced

Engine options: precision of weights and KV cache, speculative decoding (turned on in a row only
where it raises the goodput within the SLO), LoRA adapters (their per-step cost and slots).

Pure: everything the planner reads (mix, sweeps, ramp) arrives already parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from inferbus.timing import GB, GPUS, KV_LINKS, PRECISIONS, PRESETS, KvLink, RooflineModel, SpecDecoding, roofline
from tools.capacity.plan.costs import Cost, fleet_cost
from tools.capacity.plan.disagg import DisaggRow, price_pair
from tools.capacity.plan.model import Assumptions, Goodput, OperatingPoint, ReplicaModel, Slo, Workload
from tools.capacity.plan.sizing import (
    FORECAST_ERROR,
    POOLED_FROM_REPLICAS,
    POOLED_MODEL_ERROR,
    FleetTerms,
    PooledGoodputs,
    Replicas,
)
from tools.capacity.plan.sweep_table import SweepGoodput
from tools.capacity.plan.warm_pool import Ramp, WarmPool


class PlanError(ValueError):
    """Inputs the planner cannot use; the message says which and what is allowed."""


PREFILL_QUEUES = ("per-replica", "pooled")


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
    forecast_error: float = FORECAST_ERROR  # the busiest minute above the planned peak (sizing.py)
    cold_start_s: float = 120.0
    warm_start_s: float = 5.0
    ramp: Ramp | None = None
    weights: str = "fp8"  # precision of the weights (PRECISIONS)
    kv_cache: str = "fp8"  # precision of the KV cache
    spec: SpecDecoding | None = None  # a candidate: each row uses it only where it raises goodput
    lora_adapters: int = 0  # distinct adapters the traffic spreads over evenly
    lora_rank: int = 16
    lora_slots: int = 8  # SGLang --max-loras-per-batch
    zones: int = 1  # >1: the serving fleet survives the loss of one zone
    disaggregation: bool = True  # also price prefill/decode pools (disagg.py)
    kv_link: KvLink = KV_LINKS["rdma"]  # the link prefill sends KV to decode over (an assumption)
    # How placement treats the replicas' prefill queues: "pooled" (one M/G/c, as the router's default
    # affinity policy makes them by placing on the least queued prefill work; queueing.py; a fleet
    # serving fewer than POOLED_FROM_REPLICAS is priced per replica) or "per-replica" (each its own
    # M/G/1, as a random or request-counting placement leaves them).
    prefill_queue: str = "pooled"
    # The model's error where a pooled prefill queue sets the fleet (TTFT binds; sizing.py says why).
    pooled_model_error: float = POOLED_MODEL_ERROR

    def __post_init__(self) -> None:
        if not self.rate_rps > 0:
            raise PlanError("the planned rate must be positive")
        if self.headroom < 0 or self.forecast_error < 0:
            raise PlanError("headroom and forecast error must not be negative")
        if self.weights not in PRECISIONS or self.kv_cache not in PRECISIONS:
            raise PlanError(f"precision must be one of {', '.join(sorted(PRECISIONS))}")
        if self.lora_adapters < 0 or self.lora_rank < 1 or self.lora_slots < 1:
            raise PlanError("LoRA adapters must not be negative, rank and slots at least 1")
        if self.zones < 1:
            raise PlanError("zones must be at least 1")
        unknown = [g for g in self.gpu_prices if g not in GPUS]
        if unknown:
            raise PlanError(f"unknown GPU {', '.join(unknown)}; known: {', '.join(sorted(GPUS))}")
        if any(p < 0 for p in self.gpu_prices.values()):
            raise PlanError("GPU prices must not be negative")
        if self.preset not in PRESETS:
            raise PlanError(f"unknown preset {self.preset!r}; known: {', '.join(sorted(PRESETS))}")
        if self.prefill_queue not in PREFILL_QUEUES:
            raise PlanError(f"prefill queue must be one of {', '.join(PREFILL_QUEUES)}")
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
    replicas_exact: float = 0.0  # the headroom's term before rounding up (sizing.py)
    sizing: Replicas | None = None
    fleet_point: OperatingPoint | None = None  # the model at the fleet's operating rate (cost split)
    cost: Cost | None = None
    warm: WarmPool | None = None
    curve: tuple[OperatingPoint, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    spec_on: bool = False  # speculative decoding chosen for this row
    spec_goodput_rps: float | None = None  # the model's goodput with the candidate, when one was given
    plain_goodput_rps: float | None = None  # and without it
    pool: int | None = None  # pooled prefill queues: the replicas the goodput is for (c = serving(N))
    # Priced pooled, the fleet would serve this few (below POOLED_FROM_REPLICAS): priced per replica instead.
    unpooled: int | None = None
    # Pooled: one replica's goodput by the replicas serving, for the autoscaler (fewer pool less).
    pooled: PooledGoodputs | None = field(default=None, compare=False, repr=False)

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
        """Serving GPUs plus the warm pool's: every GPU the row keeps running (and prices)."""
        return self.gpus + (self.warm.gpus if self.warm else 0)

    @property
    def warm_replicas(self) -> int:
        return self.warm.replicas if self.warm else 0


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    rows: tuple[Row, ...]
    disaggregated: tuple[DisaggRow, ...] = ()  # every prefill TP × decode TP pair per GPU type

    @property
    def cheapest(self) -> Row | None:
        feasible = [r for r in self.rows if r.feasible and r.cost]
        return min(feasible, key=lambda r: (r.cost.usd_per_hour, r.gpus)) if feasible else None  # type: ignore[union-attr]


def zone_factor(zones: int) -> float:
    """Spare serving capacity for losing one of `zones` zones: Z ÷ (Z − 1), 1 with a single zone."""
    return zones / (zones - 1) if zones > 1 else 1.0


def fleet_terms(inputs: PlanInputs) -> FleetTerms:
    return FleetTerms(rate_rps=inputs.rate_rps, headroom=inputs.headroom, zone_factor=zone_factor(inputs.zones),
                      forecast_error=inputs.forecast_error, ramp=inputs.ramp, cold_start_s=inputs.cold_start_s,
                      warm_start_s=inputs.warm_start_s)


def _no_kv_reason(model: RooflineModel) -> str:
    usable = model.tp * model.gpu.hbm_bytes * 0.92 / GB
    needed = (model.model.weight_bytes + 4 * GB * model.tp) / GB
    return (f"the model leaves no room for a KV cache: {model.model.weight_bytes / GB:.1f} GB of weights + "
            f"{4 * model.tp} GB reserve = {needed:.1f} GB ≥ {usable:.1f} GB usable HBM "
            f"({model.tp} × {model.gpu.hbm_bytes / GB:.0f} GB × 92%)")


def replica_model(inputs: PlanInputs, gpu: str, tp: int, spec: SpecDecoding | None) -> ReplicaModel:
    """One replica of `gpu` × `tp` with the plan's engine options (and `spec`, if any)."""
    try:
        step_model = roofline(gpu, tp, inputs.preset, weights=inputs.weights, kv_cache=inputs.kv_cache, spec=spec,
                              lora_rank=inputs.lora_rank if inputs.lora_adapters else 0,
                              lora_slots=inputs.lora_slots if inputs.lora_adapters else 0)
    except ValueError as error:
        raise PlanError(str(error)) from None
    return ReplicaModel(step_model, step_model.kv_capacity_tokens(), inputs.workload, inputs.assumptions,
                        lora_adapters=inputs.lora_adapters, lora_slots=inputs.lora_slots)


def plan_row(inputs: PlanInputs, gpu: str, tp: int, sweep: SweepGoodput | None = None) -> Row:
    replica = replica_model(inputs, gpu, tp, None)
    model_goodput = replica.goodput(inputs.slo)
    spec_on, spec_rps, plain_rps = False, None, None
    if inputs.spec is not None and replica.kv_capacity_tokens > 0:
        speculative = replica_model(inputs, gpu, tp, inputs.spec)
        spec_goodput = speculative.goodput(inputs.slo)
        plain_rps, spec_rps = model_goodput.rps, spec_goodput.rps
        # On only where it raises goodput within the SLO (and a measured sweep does not decide).
        if sweep is None and spec_goodput.feasible and spec_goodput.rps > model_goodput.rps:
            replica, model_goodput, spec_on = speculative, spec_goodput, True
    step_model = replica.step_model
    assert isinstance(step_model, RooflineModel)
    capacity = replica.kv_capacity_tokens
    price = inputs.gpu_prices[gpu]
    row = partial(Row, gpu=gpu, tp=tp, usd_per_gpu_hour=price, kv_capacity_tokens=int(capacity),
                  model_goodput=model_goodput, sweep=sweep, spec_on=spec_on, spec_goodput_rps=spec_rps,
                  plain_goodput_rps=plain_rps)
    if capacity <= 0:
        return row(source="model", goodput_rps=0.0, binding=None, point=None, infeasible=_no_kv_reason(step_model))
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
    terms = fleet_terms(inputs)
    pool = None
    pooled = (pooled_fleet(replica, inputs.slo, terms, model_goodput, inputs.pooled_model_error)
              if inputs.prefill_queue == "pooled" and source == "model" else None)
    if pooled is not None and pooled[2] >= POOLED_FROM_REPLICAS:
        by_serving = PooledGoodputs(partial(pooled_goodput, replica, inputs.slo, model_goodput), model_goodput.rps,
                                    pooled[1].count)
        replica, sizing, pool = pooled
        model_goodput = replica.goodput(inputs.slo)
        rps, binding, point = model_goodput.rps, model_goodput.binding, model_goodput.point
        row = partial(row, model_goodput=model_goodput, pool=pool, pooled=by_serving)
    else:
        # Too few replicas to pool (affinity keeps a conversation on the replica holding its
        # prefix, and three queues are not one): each replica's own queue prices it.
        sizing = terms.replicas(rps)
        if pooled is not None:
            row = partial(row, unpooled=pooled[2])
    replicas = sizing.count
    fleet_point = replica.at(inputs.rate_rps / replicas)
    warm = terms.warm(rps, tp, replicas)
    if warm is not None and not warm.covered_by_headroom:
        warnings.append(f"the rise while warm replicas wake ({warm.warm_start_rise_rps:.1f} req/s in "
                        f"{inputs.warm_start_s:g} s) exceeds the fleet's headroom ({warm.headroom_rps:.1f} req/s)")
    cost = fleet_cost(rate_rps=inputs.rate_rps, workload=inputs.workload, replica_rps=rps, replicas=replicas, tp=tp,
                      usd_per_gpu_hour=price, prefill_share=fleet_point.prefill_share,
                      warm_replicas=warm.replicas if warm else 0)
    if point is not None and point.stable and point.kv_fraction > inputs.assumptions.kv_limit:
        warnings.append(f"the model puts KV use at {point.kv_fraction:.0%} at the measured goodput, over the "
                        f"{inputs.assumptions.kv_limit:.0%} limit")
    curve_to = max(rps, model_goodput.rps if model_goodput.feasible else 0.0) * 1.3
    return row(source=source, goodput_rps=rps, binding=binding, point=point, replicas=replicas,
               replicas_exact=sizing.by_headroom, sizing=sizing, fleet_point=fleet_point, cost=cost, warm=warm,
               curve=tuple(replica.curve(curve_to)), warnings=tuple(warnings))


def pooled_fleet(replica: ReplicaModel, slo: Slo, terms: FleetTerms, alone: Goodput,
                 pooled_error: float) -> tuple[ReplicaModel, Replicas, int]:
    """The fleet of `replica` when the router pools their prefill queues: only the TTFT limit grows
    with the pool (`alone`, the replica's own queue, gives the others), so the fixed point of
    `FleetTerms.pooled` costs one bisection per pool size tried. Each limit sizes the fleet with its
    own model error, the larger fleet kept: the pooled TTFT's with `pooled_error`, TPOT's and KV's
    with the plan's own."""
    others = terms.replicas(_unpooled_limits(alone))
    by_ttft = replace(terms, model_error=pooled_error)
    seen: dict[int, Replicas] = {}

    def sized_at(pool: int) -> Replicas:
        if pool not in seen:
            ttft = _pooled_ttft_limit(replica, slo, pool)
            # The constraint that binds at this pool first: it wins a tie, so the report's line
            # shows the goodput the row has.
            first, second = (by_ttft.replicas(ttft), others) if ttft < others.goodput_rps else (
                others, by_ttft.replicas(ttft))
            seen[pool] = max(first, second, key=lambda sized: sized.count)
        return seen[pool]

    sizing, pool = terms.pooled(sized_at)
    return replica.with_pool(pool), sizing, pool


def pooled_goodput(replica: ReplicaModel, slo: Slo, alone: Goodput, pool: int) -> float:
    """One replica's goodput with `pool` replicas' prefill queues pooled: only the TTFT limit grows
    with the pool (`alone`, the replica's own queue, gives the others)."""
    return min(_unpooled_limits(alone), _pooled_ttft_limit(replica, slo, pool))


def _unpooled_limits(alone: Goodput) -> float:
    """The goodput TPOT and KV allow: the limits a pool of prefill queues does not move."""
    return min(limit for name, limit in alone.limits.items() if name in ("TPOT", "KV"))


def _pooled_ttft_limit(replica: ReplicaModel, slo: Slo, pool: int) -> float:
    kv_limit = replica.assumptions.kv_limit
    return replica.with_pool(pool).limit(lambda point: point.meets("TTFT", slo, kv_limit))


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
    rows = tuple(plan_row(inputs, gpu, tp, by_config.get((gpu, tp))) for gpu, tp in configs)
    return Plan(inputs, rows, disaggregated_rows(inputs) if inputs.disaggregation else ())


def disaggregated_rows(inputs: PlanInputs) -> tuple[DisaggRow, ...]:
    """Every prefill TP × decode TP pair of the plan's widths, per GPU type (the timing model only: no
    speculative decoding or LoRA in either pool)."""
    terms = fleet_terms(inputs)
    out = []
    for gpu, price in inputs.gpu_prices.items():
        models = {tp: roofline(gpu, tp, inputs.preset, weights=inputs.weights, kv_cache=inputs.kv_cache)
                  for tp in inputs.tps}
        for tp_p in inputs.tps:
            for tp_d in inputs.tps:
                out.append(price_pair(gpu=gpu, usd_per_gpu_hour=price, prefill_model=models[tp_p],
                                      decode_model=models[tp_d], workload=inputs.workload,
                                      assumptions=inputs.assumptions, slo=inputs.slo, link=inputs.kv_link,
                                      terms=terms,
                                      pooled_model_error=inputs.pooled_model_error
                                      if inputs.prefill_queue == "pooled" else None))
    return tuple(out)

