"""Dollars: the fleet's $/hour and what a million input and output tokens cost.

All-in: every GPU-hour is charged to output tokens,

    $ per 1M output tokens = $/GPU-h × 1e6 / (3600 × output tok/s per GPU × utilisation)
                           = fleet $/h ÷ (millions of output tokens served per hour),

where tok/s per GPU is at the replica's goodput and utilisation = planned rate ÷ (replicas ×
goodput), i.e. the headroom and rounding up are paid for. Every GPU the plan keeps running is
in the fleet's $/hour: the serving replicas (headroom included) and the warm pool, whose
loaded-but-idle replicas hold their GPUs too. The usual form, $/GPU-h × 1e6 ÷ (3600 × tok/s per GPU ×
utilisation) with the serving fleet's GPUs, is the serving fleet alone (`usd_per_1m_output_serving`).

Split: input and output tokens share the bill by the GPU time each causes, read from the
step-time model at the fleet's operating point (planned rate ÷ replicas per replica). The prefill
share is what the steps would save if they carried no prefill tokens, T(B, S, n_p) − T(B, S, 0),
over T(B, S, n_p); output tokens pay for the rest, the floor of every step (weights streamed,
KV read, overheads), because decoding needs a step every t anyway. Input prices are per prompt
token, cached ones included (they are what a customer is billed for); per uncached token too.

Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tools.capacity.plan.model import Workload

MILLION = 1e6
HOUR_S = 3600.0


@dataclass(frozen=True)
class Cost:
    usd_per_gpu_hour: float
    gpus: int  # serving + warm pool
    serving_gpus: int
    warm_gpus: int
    usd_per_hour: float  # every GPU: serving + warm pool
    serving_usd_per_hour: float
    output_tok_s_per_gpu: float  # at the replica's goodput
    utilisation: float  # planned rate ÷ (replicas × goodput)
    output_mtok_per_hour: float  # millions of output tokens served per hour at the planned rate
    input_mtok_per_hour: float
    usd_per_1m_output_all_in: float
    usd_per_1m_output_serving: float  # the serving fleet alone
    prefill_share: float
    usd_per_1m_input: float
    usd_per_1m_uncached_input: float
    usd_per_1m_output: float


def fleet_cost(
    *,
    rate_rps: float,
    workload: Workload,
    replica_rps: float,
    replicas: int,
    tp: int,
    usd_per_gpu_hour: float,
    prefill_share: float,
    warm_replicas: int = 0,
) -> Cost:
    serving_gpus, warm_gpus = replicas * tp, warm_replicas * tp
    gpus = serving_gpus + warm_gpus
    usd_per_hour = gpus * usd_per_gpu_hour
    out_mtok_h = rate_rps * workload.output_tokens * HOUR_S / MILLION
    in_mtok_h = rate_rps * workload.input_tokens * HOUR_S / MILLION
    uncached_mtok_h = rate_rps * workload.uncached_tokens * HOUR_S / MILLION
    # No steady state in the model at the fleet's rate (a sweep beyond the model's reach): no split.
    share = prefill_share if math.isfinite(prefill_share) else math.nan
    return Cost(
        usd_per_gpu_hour=usd_per_gpu_hour,
        gpus=gpus,
        serving_gpus=serving_gpus,
        warm_gpus=warm_gpus,
        usd_per_hour=usd_per_hour,
        serving_usd_per_hour=serving_gpus * usd_per_gpu_hour,
        output_tok_s_per_gpu=replica_rps * workload.output_tokens / tp,
        utilisation=rate_rps / (replicas * replica_rps),
        output_mtok_per_hour=out_mtok_h,
        input_mtok_per_hour=in_mtok_h,
        usd_per_1m_output_all_in=usd_per_hour / out_mtok_h,
        usd_per_1m_output_serving=serving_gpus * usd_per_gpu_hour / out_mtok_h,
        prefill_share=share,
        usd_per_1m_input=usd_per_hour * share / in_mtok_h,
        usd_per_1m_uncached_input=usd_per_hour * share / uncached_mtok_h,
        usd_per_1m_output=usd_per_hour * (1 - share) / out_mtok_h,
    )
