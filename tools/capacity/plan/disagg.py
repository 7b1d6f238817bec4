"""A disaggregated fleet priced with the same arithmetic as an aggregated replica (model.py).

Two pools: prefill replicas compute the prompts and send each prompt's KV over a link to a decode
replica; decode replicas run decode-only steps, so no prefill chunk ever stalls their streams (the
interference that makes an aggregated replica keep its batch small). Per request of the mix, as in
model.py: o mean output tokens, u mean uncached prompt tokens, E[u²], c_d, c_p, u₉₀ the p90 uncached
prompt; n the mean whole prompt and n₉₀ its p90 (the decode engine receives every prompt token's KV:
the prefix cache that saves compute is the prefill engine's). E: tokens per step (1 here).

Decode replica (TP_d) at λ_d req/s:

    t    = T(B, S, 0, 0),  B = λ_d · o · t,  S = B · c_d     the decode-only step, a fixed point
    TPOT p90 = t                                             (no chunk steps, so no spread)
    R    = λ_d · n · h                                       KV reserved for prompts on their way in
    σ²   = B · E[c²] + λ_d · h · E[n²]                       the spread of S + R
    KV use p90 = (S + R + z₉₀ · σ) ÷ capacity ≤ kv_limit
    λ_d  = the highest rate meeting TPOT and KV (each by bisection; the smaller binds)

h, how long a decode replica holds a prompt's KV reserved before it is used: SGLang's decode
engine allocates it when the pair is placed, before the prefill runs, and the transfer fills it,
so h is the request's TTFT; the plan keeps the TTFT p90 at the SLO, which is h here. The KV is
planned at its p90, not its mean: the sequences decoding and the prompts reserved are each a
Poisson number of requests (an M/G/∞ queue), so S + R spreads by σ (E[c²] the time-weighted
second moment of a decoding sequence's context, E[n²] the whole prompt's). A decode pool of a few
dozen long-context sequences per replica spreads by a quarter of its mean; planned on the mean,
such a pool ran out of KV in a busy minute (docs/planning.md).

The KV transfer of the TTFT p90's prompt (the link a stated assumption, `inferbus.timing.KV_LINKS`):

    x₉₀ = n₉₀ · KV bytes per token ÷ (min(TP_p, TP_d) · link bandwidth per GPU)

Prefill replica (TP_p) at λ_p req/s, prefill-only steps of `chunk` tokens:

    μ    = chunk ÷ T(0, 0, chunk, c_p)
    ρ    = λ_p · u ÷ μ;   W_q = λ_p · E[u²] ÷ μ² ÷ (2 (1 − ρ))   (M/G/1, as aggregated)
    TTFT_prefill p90 = u₉₀ ÷ μ + ln 10 · W_q
    (pooled by the router over the pool's c replicas: W_q and its p90 are M/G/c's, queueing.py)
    its share of the TTFT budget  = TTFT SLO − x₉₀ − t(λ_d)
    λ_p  = the highest rate whose TTFT_prefill p90 fits that share

TTFT p90 = TTFT_prefill p90 + x₉₀ + t: the prompt's prefill, its KV's transfer (after the last
chunk, none of it overlapped: conservative, SGLang sends each chunk's KV as it is computed), then
up to one decode step until the decode replica takes the landed request in and sends the first
token, which the prefill sampled (`DECODE_FIRST_TOKEN_STEPS`).

Fleet: N_p and N_d each by the rule every fleet is sized by (sizing.py): the headroom, or, in a
pool of a few replicas, one replica beyond what the busiest minute needs (forecast and model error
included), whichever is more; the P:D ratio is
N_p · TP_p : N_d · TP_d GPUs; each pool has its own warm pool for the ramp; GPUs = (N_p + warm_p) ·
TP_p + (N_d + warm_d) · TP_d. Every TP_p × TP_d pair of the plan's widths is priced per GPU type
(both pools on one GPU type).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from inferbus.timing import KvLink, RooflineModel
from tools.capacity.plan.model import Z90, Assumptions, ReplicaModel, Slo, Workload
from tools.capacity.plan.queueing import prefill_wait
from tools.capacity.plan.sizing import POOLED_FROM_REPLICAS, FleetTerms, PooledGoodputs, Replicas
from tools.capacity.plan.warm_pool import WarmPool

# Decode steps between a prompt's KV landing and its first token leaving: the decode engine takes the
# request in at its next step boundary and sends the token the prefill sampled (SGLang's decode side
# runs no forward for it).
DECODE_FIRST_TOKEN_STEPS = 1.0
_MIN_RATE = 1e-6
_MAX_RATE = 1e6
_BISECTIONS = 50


def highest_rate(holds: Callable[[float], bool]) -> float:
    """The highest rate at which `holds(rate)` is true (0: not even at a trickle; inf: never false)."""
    if not holds(_MIN_RATE):
        return 0.0
    low, high = _MIN_RATE, 1.0
    while holds(high):
        low, high = high, high * 2
        if high > _MAX_RATE:
            return math.inf
    for _ in range(_BISECTIONS):
        mid = (low + high) / 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low


@dataclass(frozen=True)
class DecodePoint:
    rate_rps: float
    stable: bool
    step_s: float
    batch: float
    resident_tokens: float  # S: the decoding sequences' KV
    reserved_tokens: float  # R: KV reserved for prompts on their way in
    kv_fraction: float  # (S + R + spread) ÷ capacity: the p90 of the KV held
    tpot_p90_s: float
    spread_tokens: float = 0.0  # z₉₀ × the standard deviation of S + R


@dataclass(frozen=True)
class DecodeReplica:
    """One decode-only replica: every step decodes, none carries a prefill chunk."""

    step_model: RooflineModel
    kv_capacity_tokens: float
    workload: Workload
    assumptions: Assumptions
    hold_s: float  # how long a prompt's KV is reserved before the transfer fills it

    def _steady(self) -> ReplicaModel:
        # The aggregated replica's fixed point with nothing to prefill is the decode-only step.
        w = replace(self.workload, cached_tokens=self.workload.input_tokens, uncached_sq=0.0)
        return ReplicaModel(self.step_model, self.kv_capacity_tokens, w, self.assumptions)

    def at(self, rate: float) -> DecodePoint:
        w = self.workload
        step = self._steady().step_at(rate)
        reserved = rate * w.input_tokens * self.hold_s
        if step is None:
            inf = math.inf
            return DecodePoint(rate, False, inf, inf, inf, reserved, inf, inf)
        batch = rate * w.output_tokens * step
        resident = batch * w.decode_ctx_tokens
        # The sequences decoding, and the prompts reserved, are each a Poisson number (an M/G/∞
        # queue) of independent contexts, so each sum's variance is its mean count × E[context²].
        spread = Z90 * math.sqrt(batch * w.decode_ctx_sq + rate * self.hold_s * w.input_sq)
        capacity = self.kv_capacity_tokens
        kv = (resident + reserved + spread) / capacity if capacity > 0 else math.inf
        return DecodePoint(rate, True, step, batch, resident, reserved, kv, step, spread)

    def limits(self, slo: Slo) -> dict[str, float]:
        kv_limit = self.assumptions.kv_limit
        return {
            "TPOT": highest_rate(lambda r: (p := self.at(r)).stable and p.tpot_p90_s <= slo.tpot_p90_s),
            "KV": highest_rate(lambda r: (p := self.at(r)).stable and p.kv_fraction <= kv_limit),
        }


@dataclass(frozen=True)
class PrefillPoint:
    rate_rps: float
    stable: bool
    chunk_step_s: float  # T(0, 0, chunk, c_p)
    prefill_rate_tok_s: float  # μ
    load: float  # ρ
    queue_wait_s: float  # W_q (mean)
    compute_p90_s: float  # u₉₀ ÷ μ
    ttft_p90_s: float  # the prefill's part of TTFT p90


@dataclass(frozen=True)
class PrefillReplica:
    """One prefill-only replica: whole chunks, one after another, FIFO."""

    step_model: RooflineModel
    workload: Workload
    assumptions: Assumptions
    pool: int | None = None  # replicas whose queues the router pools into one (None: each its own)

    @property
    def chunk_step_s(self) -> float:
        a, w = self.assumptions, self.workload
        return self.step_model.step_time(0, 0, a.chunk_tokens, w.prefill_ctx_tokens)

    def at(self, rate: float) -> PrefillPoint:
        a, w = self.assumptions, self.workload
        step = self.chunk_step_s
        mu = a.chunk_tokens / step
        rho = rate * w.uncached_tokens / mu
        compute = w.ttft_tokens / mu
        if rho >= 1.0:
            return PrefillPoint(rate, False, step, mu, rho, math.inf, compute, math.inf)
        if self.pool is None:
            wait = rate * w.uncached_sq / mu**2 / (2 * (1 - rho))
            return PrefillPoint(rate, True, step, mu, rho, wait, compute, compute + a.wait_p90_factor * wait)
        pooled = prefill_wait(rate, w.uncached_tokens / mu, w.uncached_sq / mu**2, self.pool)
        return PrefillPoint(rate, True, step, mu, rho, pooled.mean_s, compute, compute + pooled.p90_s)

    def goodput(self, budget_s: float) -> float:
        """The highest rate whose prefill TTFT p90 fits in `budget_s` (its share of the TTFT SLO)."""
        if budget_s <= 0:
            return 0.0
        return highest_rate(lambda r: (p := self.at(r)).stable and p.ttft_p90_s <= budget_s)


@dataclass(frozen=True)
class DisaggRow:
    """A prefill pool of TP_p replicas and a decode pool of TP_d replicas on one GPU type."""

    gpu: str
    tp_prefill: int
    tp_decode: int
    usd_per_gpu_hour: float
    link: KvLink
    transfer_p90_s: float  # x₉₀
    transfer_tokens: float  # n₉₀
    kv_bytes_per_token: float
    decode_limits: dict[str, float]
    decode_rps: float  # λ_d
    decode_binding: str | None
    decode_point: DecodePoint | None
    decode_kv_capacity_tokens: int
    prefill_budget_s: float  # the prefill's share of the TTFT SLO
    prefill_rps: float  # λ_p
    prefill_point: PrefillPoint | None
    prefill_replicas: int = 0
    decode_replicas: int = 0
    prefill_sizing: Replicas | None = None
    decode_sizing: Replicas | None = None
    prefill_warm: WarmPool | None = None
    decode_warm: WarmPool | None = None
    infeasible: str | None = None
    prefill_pool: int | None = None  # pooled prefill queues: the replicas the prefill goodput is for
    prefill_unpooled: int | None = None  # priced pooled, the pool would serve this few: priced per replica instead
    # Pooled: one prefill replica's goodput by the replicas serving, for the autoscaler (fewer pool less).
    prefill_pooled: PooledGoodputs | None = field(default=None, compare=False, repr=False)
    ttft_steps: float = DECODE_FIRST_TOKEN_STEPS  # decode steps between the KV landing and the first token

    @property
    def name(self) -> str:
        return f"{self.gpu} prefill TP{self.tp_prefill} + decode TP{self.tp_decode}"

    @property
    def feasible(self) -> bool:
        return self.infeasible is None

    @property
    def prefill_gpus(self) -> int:
        return self.prefill_replicas * self.tp_prefill

    @property
    def decode_gpus(self) -> int:
        return self.decode_replicas * self.tp_decode

    @property
    def gpus(self) -> int:
        """Serving GPUs of both pools (headroom included)."""
        return self.prefill_gpus + self.decode_gpus

    @property
    def warm_gpus(self) -> int:
        return sum(w.gpus for w in (self.prefill_warm, self.decode_warm) if w is not None)

    @property
    def gpus_total(self) -> int:
        return self.gpus + self.warm_gpus

    @property
    def usd_per_hour(self) -> float:
        return self.gpus_total * self.usd_per_gpu_hour

    @property
    def ttft_p90_s(self) -> float:
        """Prefill p90 + transfer + the decode steps to the first token, at both pools' goodputs."""
        if self.prefill_point is None or self.decode_point is None:
            return math.nan
        return self.prefill_point.ttft_p90_s + self.transfer_p90_s + self.decode_steps_s

    @property
    def decode_steps_s(self) -> float:
        return self.decode_point.step_s * self.ttft_steps if self.decode_point else math.nan

    @property
    def ratio(self) -> str:
        """P:D in GPUs, e.g. '3:1'."""
        p, d = self.prefill_gpus, self.decode_gpus
        if not p or not d:
            return "–"
        g = math.gcd(p, d)
        return f"{p // g}:{d // g}" if max(p, d) // g <= 20 else f"{p / d:.2f}:1"


def price_pair(*, gpu: str, usd_per_gpu_hour: float, prefill_model: RooflineModel, decode_model: RooflineModel,
               workload: Workload, assumptions: Assumptions, slo: Slo, link: KvLink, terms: FleetTerms,
               pooled_model_error: float | None = None) -> DisaggRow:
    """One prefill TP × decode TP pair on `gpu`: both pools' goodputs, the TTFT split, the fleet.
    `pooled_model_error`: the router pools the prefill replicas' queues (the prefill goodput is then
    the pool's, and the pool, set by TTFT, is sized with this model error); None: each its own."""
    tp_p, tp_d = prefill_model.tp, decode_model.tp
    n90 = workload.transfer_tokens
    transfer = link.transfer_s(n90, tp_p, tp_d, decode_model.model)
    capacity = decode_model.kv_capacity_tokens()
    base = dict(gpu=gpu, tp_prefill=tp_p, tp_decode=tp_d, usd_per_gpu_hour=usd_per_gpu_hour, link=link,
                transfer_p90_s=transfer, transfer_tokens=n90, decode_kv_capacity_tokens=capacity,
                kv_bytes_per_token=decode_model.model.kv_bytes_per_token)
    if capacity <= 0 or prefill_model.kv_capacity_tokens() <= 0:
        return DisaggRow(**base, decode_limits={}, decode_rps=0.0, decode_binding=None,  # type: ignore[arg-type]
                         decode_point=None, prefill_budget_s=math.nan, prefill_rps=0.0, prefill_point=None,
                         infeasible="the model leaves no room for a KV cache on "
                                    f"{gpu} TP{tp_d if capacity <= 0 else tp_p}")
    decode = DecodeReplica(decode_model, capacity, workload, assumptions, hold_s=slo.ttft_p90_s)
    limits = decode.limits(slo)
    binding = min(limits, key=lambda c: limits[c])
    decode_rps = limits[binding]
    if decode_rps <= 0 or math.isinf(decode_rps):
        reason = ("even an idle decode replica misses TPOT" if binding == "TPOT"
                  else "the decode replica's KV cache cannot hold even one sequence")
        return DisaggRow(**base, decode_limits=limits, decode_rps=0.0, decode_binding=binding,  # type: ignore[arg-type]
                         decode_point=decode.at(_MIN_RATE), prefill_budget_s=math.nan, prefill_rps=0.0,
                         prefill_point=None, infeasible=reason)
    decode_point = decode.at(decode_rps)
    budget = slo.ttft_p90_s - transfer - DECODE_FIRST_TOKEN_STEPS * decode_point.step_s
    prefill = PrefillReplica(prefill_model, workload, assumptions)
    prefill_rps = prefill.goodput(budget)
    row = DisaggRow(**base, decode_limits=limits, decode_rps=decode_rps, decode_binding=binding,  # type: ignore[arg-type]
                    decode_point=decode_point, prefill_budget_s=budget, prefill_rps=prefill_rps,
                    prefill_point=prefill.at(prefill_rps) if prefill_rps > 0 else prefill.at(_MIN_RATE))
    if prefill_rps <= 0:
        idle = prefill.at(_MIN_RATE)
        why = (f"the KV transfer ({transfer * 1e3:,.0f} ms) and the decode steps leave the prefill no TTFT budget"
               if budget <= 0 else
               f"even an idle prefill replica needs {idle.ttft_p90_s * 1e3:,.0f} ms for the p90 prompt, over its "
               f"{budget * 1e3:,.0f} ms share of the TTFT SLO")
        return replace(row, infeasible=why)
    n_d = terms.replicas(decode_rps)
    n_p = terms.replicas(prefill_rps)
    if pooled_model_error is not None:
        by_ttft = replace(terms, model_error=pooled_model_error)
        n_pooled, pool = terms.pooled(lambda c: by_ttft.replicas(replace(prefill, pool=c).goodput(budget)))
        if pool >= POOLED_FROM_REPLICAS:  # fewer do not pool: each replica's own queue prices them
            alone, n_p, prefill = prefill_rps, n_pooled, replace(prefill, pool=pool)
            prefill_rps = prefill.goodput(budget)
            by_serving = PooledGoodputs(partial(_pooled_prefill_goodput, prefill, budget), alone, n_p.count)
            row = replace(row, prefill_rps=prefill_rps, prefill_point=prefill.at(prefill_rps), prefill_pool=pool,
                          prefill_pooled=by_serving)
        else:
            row = replace(row, prefill_unpooled=pool)
    return replace(row, prefill_replicas=n_p.count, decode_replicas=n_d.count, prefill_sizing=n_p, decode_sizing=n_d,
                   prefill_warm=terms.warm(prefill_rps, tp_p, n_p.count),
                   decode_warm=terms.warm(decode_rps, tp_d, n_d.count))


def _pooled_prefill_goodput(prefill: PrefillReplica, budget_s: float, pool: int) -> float:
    return replace(prefill, pool=pool).goodput(budget_s)


def cheapest(rows: tuple[DisaggRow, ...] | list[DisaggRow]) -> DisaggRow | None:
    feasible = [r for r in rows if r.feasible]
    return min(feasible, key=lambda r: (r.usd_per_hour, r.gpus_total)) if feasible else None
