"""The routing benchmark's workload: which trace requests are replayed, when, and how hard they load
the fleet. Pure computation (no I/O besides reading the trace), so it can be checked on its own.

- Selection: requests that fit the context window, optionally a random share of the trace's prefix
  families (all requests whose first block id was drawn: a family's reuse pattern stays whole,
  so the infinite-cache ceiling stays near the full trace's), then the first `--requests`.
- Two hit-rate references: the **ceiling** (infinite cache, `tools.capacity.traces.ideal_hit_rate`) and
  the **finite-cache bound**: every family pinned to one engine (perfect affinity), each engine an
  LRU cache of its KV capacity in 512-token blocks. No router can be expected to beat the bound by
  much on these engines (only a cache bigger than the KV pool could), and it ignores the KV that
  running requests hold, so real engines fall somewhat short of it even with perfect routing.
- Load: every request's GPU time is priced with the simulated engine's own step-time model
  (`inferbus/timing.py`), assuming the bound's hits; arrivals are stretched or
  compressed so that this work keeps the fleet `load` busy (0.8 = 80%). See `gpu_seconds`.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from inferbus.timing import RooflineModel, roofline
from tools.capacity import traces
from tools.capacity.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

CONTEXT_LENGTH = 131_072  # the sim engine's and the gateway's context window


@dataclass(frozen=True)
class Workload:
    requests: list[TraceRequest]  # arrival_s already scaled (simulated seconds from the start)
    dropped_too_long: int  # prompt + output longer than the context window
    families_total: int
    families_kept: int
    ceiling_hit_rate: float  # infinite cache
    bound_hit_rate: float  # perfect affinity, LRU of the engines' KV capacity
    round_robin_lru_hit_rate: float  # the same caches, requests dealt round-robin (a floor for comparison)
    gpu_seconds: float  # total engine work at the bound's hits (simulated seconds)
    gpu_seconds_no_cache: float
    trace_span_s: float  # span of the selection before scaling
    arrival_factor: float  # arrival times multiplied by this
    span_s: float  # after scaling (simulated seconds)
    engines: int
    kv_capacity_tokens: int
    load: float  # target utilisation at the bound's hits

    @property
    def rate(self) -> float:
        return traces.rate(self.requests)

    def summary(self) -> dict:
        n = len(self.requests)
        return {
            "requests": n, "dropped_too_long": self.dropped_too_long,
            "families_total": self.families_total, "families_kept": self.families_kept,
            "mean_input_tokens": sum(r.input_tokens for r in self.requests) / n,
            "mean_output_tokens": sum(r.output_tokens for r in self.requests) / n,
            "ceiling_hit_rate": self.ceiling_hit_rate, "bound_hit_rate": self.bound_hit_rate,
            "round_robin_lru_hit_rate": self.round_robin_lru_hit_rate,
            "gpu_seconds": self.gpu_seconds, "gpu_seconds_no_cache": self.gpu_seconds_no_cache,
            "trace_span_s": self.trace_span_s, "arrival_factor": self.arrival_factor, "span_s": self.span_s,
            "rate_req_s": self.rate, "engines": self.engines, "kv_capacity_tokens": self.kv_capacity_tokens,
            "target_load": self.load, "load_no_cache": self.gpu_seconds_no_cache / (self.engines * self.span_s),
        }


def select(requests: Sequence[TraceRequest], *, sample_families: float = 1.0, limit: int | None = None,
           seed: int = 0) -> tuple[list[TraceRequest], int, int, int]:
    """(selection, dropped as too long, families in the trace, families kept)."""
    fitting = [r for r in requests if r.input_tokens + r.output_tokens <= CONTEXT_LENGTH]
    families = sorted({r.hash_ids[0] for r in fitting if r.hash_ids})
    if sample_families < 1.0:
        rng = random.Random(seed)
        keep = {f for f in families if rng.random() < sample_families}
        chosen = [r for r in fitting if r.hash_ids and r.hash_ids[0] in keep]
    else:
        chosen = list(fitting)
    if limit is not None:
        chosen = chosen[:limit]
    kept = len({r.hash_ids[0] for r in chosen if r.hash_ids})
    return chosen, len(requests) - len(fitting), len(families), kept


def lru_hits(requests: Sequence[TraceRequest], engines: int, capacity_tokens: int, route: str) -> list[int]:
    """Cached prompt tokens per request with one LRU block cache per engine.

    route "family": each prefix family on one engine (its first block id, spread by a hash);
    "round_robin": request i on engine i mod n."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    blocks = max(1, capacity_tokens // MOONCAKE_BLOCK_TOKENS)
    hits = []
    for i, request in enumerate(requests):
        if route == "family":
            first = request.hash_ids[0] if request.hash_ids else i
            cache = caches[(first * 2_654_435_761 >> 7) % engines]
        else:
            cache = caches[i % engines]
        hit = traces.replay_blocks(request, cache, blocks)
        # The engine always recomputes at least the last token (its logits give the first output).
        hits.append(min(hit, request.input_tokens - 1))
    return hits


def request_gpu_seconds(model: RooflineModel, request: TraceRequest, cached_tokens: int,
                        chunk: int = 512) -> float:
    """Simulated engine time one request costs: its uncached prompt in `chunk`-token prefill pieces
    plus its output tokens decoded in mixed batches.

    A prefill chunk of n tokens starting at position p costs n/chunk of a full chunk's fixed and GEMM
    time (the scheduler packs chunks of several requests into one step) plus its exact attention
    term (which grows with p). Each decoded token costs its marginal share of a step that is
    prefilling anyway (the common case near saturation): one more GEMM row, its KV reads over the
    context, and the per-sequence overhead. Idle-time decode-only steps are not counted, so this is
    slightly optimistic about capacity."""
    full_step = model.step_time(0, 0, chunk, 0.0)
    seconds = 0.0
    position = cached_tokens
    while position < request.input_tokens:
        n = min(chunk, request.input_tokens - position)
        attention = model.step_time(0, 0, n, position + n / 2) - model.step_time(0, 0, n, 0.0)
        seconds += full_step * n / chunk + attention
        position += n
    context = request.input_tokens + request.output_tokens / 2
    decode_token = model.step_time(1, int(context), chunk, 0.0) - full_step
    return seconds + request.output_tokens * decode_token


def build(path: str, *, engines: int, gpu: str = "H100", tp: int = 2, kv_capacity_tokens: int | None = None,
          load: float = 0.8, sample_families: float = 1.0, limit: int | None = None, seed: int = 0,
          chunk: int = 512) -> Workload:
    requests, dropped, families_total, families_kept = select(
        traces.load(path), sample_families=sample_families, limit=limit, seed=seed)
    if len(requests) < 2:
        raise SystemExit("the selection has fewer than two requests")
    model = roofline(gpu, tp)
    capacity = kv_capacity_tokens or model.kv_capacity_tokens()
    bound = lru_hits(requests, engines, capacity, "family")
    dealt = lru_hits(requests, engines, capacity, "round_robin")
    total_in = sum(r.input_tokens for r in requests)
    gpu_s = sum(request_gpu_seconds(model, r, h, chunk) for r, h in zip(requests, bound))
    gpu_s_cold = sum(request_gpu_seconds(model, r, 0, chunk) for r in requests)
    start = requests[0].arrival_s
    span = requests[-1].arrival_s - start
    # Work per second of trace over what the fleet can do per second = native utilisation.
    native_load = gpu_s / (engines * span)
    factor = native_load / load
    scaled = [TraceRequest((r.arrival_s - start) * factor, r.input_tokens, r.output_tokens, r.hash_ids)
              for r in requests]
    return Workload(
        requests=scaled, dropped_too_long=dropped, families_total=families_total, families_kept=families_kept,
        ceiling_hit_rate=traces.ideal_hit_rate(requests), bound_hit_rate=sum(bound) / total_in,
        round_robin_lru_hit_rate=sum(dealt) / total_in, gpu_seconds=gpu_s, gpu_seconds_no_cache=gpu_s_cold,
        trace_span_s=span, arrival_factor=factor, span_s=span * factor, engines=engines,
        kv_capacity_tokens=capacity, load=load,
    )
