"""How fast a trace must be replayed to load a fleet to a given fraction of its capacity.

The capacity of one replica comes from the simulated engine's roofline (inferbus/timing.py): a replica
is saturated when every engine step carries a full chunked-prefill budget. In that steady state,
with mean uncached prompt tokens `u` and mean output tokens `o` per request:

    λ_max = chunk / (u · t_step)        requests/s one replica can take
    B     = λ · o · t_step = chunk · o / u      decode sequences riding along each step
    S     = B · ctx_decode                      their resident context
    t_step = T(B, S, chunk, ctx_prefill)        the perf model's step time

`ctx_prefill` is the token-weighted mean attended context of prefill tokens (a chunk starting at
position c of size n attends to about c + n/2 tokens), `ctx_decode` the output-weighted mean
context of a decoding sequence. The fleet's capacity is `replicas · λ_max` and the replay rate
for load ρ is `ρ · replicas · λ_max`.

What counts as uncached (`basis`) decides how much work a request is:
- "none": no prefix-cache reuse; every prompt token is prefilled (the fleet is at ρ whatever the
  router does, and cache hits only make it lighter);
- "ideal": the trace's infinite-cache hit rate, replayed in order (what a perfect prefix-aware
  router could reach; a policy that misses hits pushes the fleet past ρ).

Live benchmarks should call `rate_for_load` too, so the simulator and the live runs agree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from inferbus.timing import FixedStepModel, StepTimeModel, roofline
from services.sim_engine.config import EngineConfig
from tools.capacity.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, replay_blocks

Basis = Literal["none", "ideal"]


@dataclass(frozen=True)
class CapacityEstimate:
    basis: str
    requests: int
    mean_input_tokens: float
    mean_uncached_tokens: float
    mean_output_tokens: float
    prefill_ctx_tokens: float
    decode_ctx_tokens: float
    decode_batch: float
    step_s: float
    replica_rps: float  # λ_max of one replica

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ideal_cached_tokens(requests: Sequence[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """Per request, the prompt tokens an infinite cache would hold when it arrives (time order).

    Same rule as `tools.capacity.traces.ideal_hit_rate`; at least one prompt token is always computed.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    return [min(replay_blocks(request, cache, block_tokens=block_tokens), max(0, request.input_tokens - 1))
            for request in requests]


def lru_hit_rate(requests: Sequence[TraceRequest], capacity_tokens: int) -> float:
    """Token-weighted hit rate of one LRU prefix cache of `capacity_tokens`, replayed in time order.

    With the fleet's total KV capacity this is about the best any router can do on that fleet
    (running requests' KV, which also competes for the space, is ignored), between the infinite
    cache (`tools.capacity.traces.ideal_hit_rate`) and a single replica's cache.
    """
    limit = max(1, capacity_tokens // MOONCAKE_BLOCK_TOKENS)
    cache: OrderedDict[int, None] = OrderedDict()
    hit = sum(replay_blocks(request, cache, limit) for request in requests)
    total = sum(request.input_tokens for request in requests)
    return hit / total if total else 0.0


def estimate(
    requests: Sequence[TraceRequest],
    config: EngineConfig,
    *,
    basis: Basis = "none",
    step_model: StepTimeModel | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> CapacityEstimate:
    """One replica's saturated request rate on this trace's mix (see the module docstring)."""
    if not requests:
        raise ValueError("no requests")
    if basis not in ("none", "ideal"):
        raise ValueError(f"basis must be 'none' or 'ideal', got {basis!r}")
    if step_model is None:
        step_model = (
            FixedStepModel(config.fixed_step_ms / 1000.0) if config.fixed_step_ms is not None
            else roofline(config.gpu, config.tp, config.preset)
        )
    cached = ideal_cached_tokens(requests, block_tokens) if basis == "ideal" else [0] * len(requests)
    n = len(requests)
    uncached_total = prefill_ctx = 0.0
    output_total = decode_ctx = 0.0
    for request, hit in zip(requests, cached):
        uncached = request.input_tokens - hit
        uncached_total += uncached
        prefill_ctx += uncached * (hit + request.input_tokens) / 2
        output_total += request.output_tokens
        decode_ctx += request.output_tokens * (request.input_tokens + request.output_tokens / 2)
    u = uncached_total / n
    o = output_total / n
    ctx_p = prefill_ctx / uncached_total if uncached_total else 0.0
    ctx_d = decode_ctx / output_total if output_total else 0.0
    chunk = config.chunked_prefill_size
    batch = min(chunk * o / u if u else float(config.max_running_requests), config.max_running_requests)
    step_s = step_model.step_time(round(batch), int(batch * ctx_d), chunk, ctx_p)
    return CapacityEstimate(
        basis=basis,
        requests=n,
        mean_input_tokens=sum(r.input_tokens for r in requests) / n,
        mean_uncached_tokens=u,
        mean_output_tokens=o,
        prefill_ctx_tokens=ctx_p,
        decode_ctx_tokens=ctx_d,
        decode_batch=batch,
        step_s=step_s,
        replica_rps=chunk / (u * step_s) if u else float("inf"),
    )


def rate_for_load(
    requests: Sequence[TraceRequest],
    config: EngineConfig,
    replicas: int,
    load: float = 0.8,
    *,
    basis: Basis = "none",
    step_model: StepTimeModel | None = None,
) -> float:
    """Arrival rate (req/s) that loads `replicas` engines to `load` of their capacity."""
    return load * replicas * estimate(requests, config, basis=basis, step_model=step_model).replica_rps


def replicas_for_rate(
    requests: Sequence[TraceRequest],
    config: EngineConfig,
    rate_rps: float,
    load: float = 0.8,
    *,
    basis: Basis = "none",
    step_model: StepTimeModel | None = None,
) -> float:
    """Replicas needed to serve `rate_rps` of this mix at `load` (fractional; round up yourself)."""
    return rate_rps / (load * estimate(requests, config, basis=basis, step_model=step_model).replica_rps)
