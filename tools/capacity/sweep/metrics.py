"""Per-request records → one step's statistics (pure: no I/O, no clock).

Definitions follow NVIDIA aiperf's (0.13, `aiperf/metrics/types/`), so the two tools agree:

- TTFT = first content chunk − request sent.
- E2E (aiperf "request latency") = last content chunk − request sent (usage-only chunks and
  `[DONE]` do not count).
- TPOT = (E2E − TTFT) / (output tokens − 1), per request (aiperf calls this "inter token latency";
  vLLM and SGLang's bench call it TPOT). Requests with fewer than 2 output tokens have none.
- ITL = the gap between consecutive content chunks, pooled over all requests (aiperf's "inter
  chunk latency", vLLM bench's ITL). Equal to TPOT's per-token time when a server streams one
  token per chunk; larger when it bundles tokens.
- Duration = last response − first request of the step; throughputs divide by it.
- Percentiles interpolate linearly between order statistics (numpy's default, which aiperf uses).
- A request meets the SLO when TTFT <= the TTFT target and TPOT <= the TPOT target (a request with
  one output token has no TPOT and is judged on TTFT alone; aiperf counts it as not good).
  Goodput (DistServe) = requests meeting the SLO per second of the step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tools.capacity.sweep.records import ClientSample, RequestRecord

# A client is the bottleneck when its one event loop is this busy: past it, responses wait in
# socket buffers and the timestamps it takes are late.
CPU_UTIL_LIMIT = 0.85
# Loop lag this large distorts individual TTFT/ITL samples by a quarter of a 40 ms TPOT target.
LOOP_LAG_P99_LIMIT_S = 0.010
# The achieved concurrency or rate below this share of the target means the client fell short.
ACHIEVED_MIN = 0.95
# slo_met tolerates at most this error rate.
MAX_ERROR_RATE = 0.001


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float = 0.8
    tpot_p90_s: float = 0.04

    def as_dict(self) -> dict[str, float]:
        return {"ttft_p90_s": self.ttft_p90_s, "tpot_p90_s": self.tpot_p90_s}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 (NaN when there are no values)."""
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def ttft(record: RequestRecord) -> float:
    return record.chunks[0] - record.start


def e2e(record: RequestRecord) -> float:
    return record.chunks[-1] - record.start


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first; None with fewer than 2 output tokens."""
    tokens = record.output_tokens if record.output_tokens is not None else len(record.chunks)
    if tokens < 2:
        return None
    return (e2e(record) - ttft(record)) / (tokens - 1)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    per_token = tpot(record)
    return ttft(record) <= slo.ttft_p90_s and (per_token is None or per_token <= slo.tpot_p90_s)


def client_verdict(client: ClientSample) -> dict[str, Any]:
    """The client's own load during a step and whether it, not the server, was the bottleneck."""
    cpu_util = client.cpu_s / client.wall_s if client.wall_s > 0 else 0.0
    lag_p99 = percentile(client.loop_lags_s, 99) if client.loop_lags_s else 0.0
    reasons = []
    if cpu_util >= CPU_UTIL_LIMIT:
        reasons.append(f"client CPU {cpu_util:.0%} of one core (limit {CPU_UTIL_LIMIT:.0%})")
    if lag_p99 > LOOP_LAG_P99_LIMIT_S:
        reasons.append(f"event-loop lag p99 {lag_p99 * 1000:.1f} ms (limit {LOOP_LAG_P99_LIMIT_S * 1000:.0f} ms)")
    if client.achieved_vs_target < ACHIEVED_MIN:
        reasons.append(f"achieved {client.achieved_vs_target:.0%} of the target load (limit {ACHIEVED_MIN:.0%})")
    return {
        "limited": bool(reasons),
        "detail": {
            "cpu_util": round(cpu_util, 4),
            "loop_lag_p99_s": round(lag_p99, 6),
            "loop_lag_max_s": round(max(client.loop_lags_s, default=0.0), 6),
            "achieved_vs_target": round(client.achieved_vs_target, 4),
            "load_avg_1m": client.load_avg_1m,
            "reissue_p50_s": round(percentile(client.reissue_s, 50), 6) if client.reissue_s else None,
            "reasons": reasons,
        },
    }


def step_stats(records: Sequence[RequestRecord], client: ClientSample, slo: SLO, *,
               concurrency: int | None = None, rate_rps: float | None = None) -> dict[str, Any]:
    """One sweep step (see the module docstring for the definitions)."""
    completed = [r for r in records if r.error is None and r.chunks]
    failed = [r for r in records if not (r.error is None and r.chunks)]
    kinds = Counter(r.error or "no_content" for r in failed)
    if records:
        first = min(r.start for r in records)
        last = max([r.chunks[-1] for r in completed] + [r.end for r in failed])
        duration = max(last - first, 1e-9)
    else:
        duration = 0.0
    per_token = [value for value in map(tpot, completed) if value is not None]
    gaps = [b - a for r in completed for a, b in zip(r.chunks, r.chunks[1:])]
    good = sum(1 for r in completed if meets_slo(r, slo))
    ttft_stats = summary([ttft(r) for r in completed])
    tpot_stats = summary(per_token)
    error_rate = len(failed) / len(records) if records else 1.0
    verdict = client_verdict(client)

    def per_second(total: float) -> float:
        return total / duration if duration > 0 else 0.0

    return {
        "concurrency": concurrency,
        "rate_rps": rate_rps,
        "duration_s": duration,
        "requests": len(records),
        "completed": len(completed),
        "errors": len(failed),
        "error_kinds": dict(sorted(kinds.items())),
        "request_rps": per_second(len(completed)),
        "input_tok_s": per_second(sum(r.input_tokens or 0 for r in completed)),
        "output_tok_s": per_second(sum(_output_tokens(r) for r in completed)),
        "cached_tok_share": _cached_share(completed),
        "ttft_s": ttft_stats,
        "tpot_s": tpot_stats,
        "itl_s": summary(gaps),
        "e2e_s": summary([e2e(r) for r in completed]),
        "slo_attainment": good / len(completed) if completed else 0.0,
        "slo_met": bool(completed) and _within(ttft_stats["p90"], slo.ttft_p90_s)
        and (not per_token or _within(tpot_stats["p90"], slo.tpot_p90_s)) and error_rate < MAX_ERROR_RATE,
        "goodput_rps": per_second(good),
        "client_limited": verdict["limited"],
        "client": verdict["detail"],
        "usage_reported": all(r.output_tokens is not None for r in completed),
    }


def _within(value: float, limit: float) -> bool:
    return not math.isnan(value) and value <= limit


def _output_tokens(record: RequestRecord) -> int:
    # The server's count; without usage, one token per content chunk (exact on one-token chunks).
    return record.output_tokens if record.output_tokens is not None else len(record.chunks)


def _cached_share(records: Sequence[RequestRecord]) -> float | None:
    prompt = sum(r.input_tokens or 0 for r in records)
    if not prompt or all(r.cached_tokens is None for r in records):
        return None
    return sum(r.cached_tokens or 0 for r in records) / prompt


def knee(steps: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The goodput knee: of the steps that meet the SLO (and were not client-limited), the one with
    the highest goodput; None when no step qualifies."""
    good = [s for s in steps if s["slo_met"] and not s["client_limited"]]
    return max(good, key=lambda s: s["goodput_rps"], default=None)
