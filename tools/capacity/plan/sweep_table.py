"""Per-replica goodput from a measured `inferbus sweep` (schema `inferbus.capacity.sweep/v1`).

Goodput (DistServe) is the highest request rate served while the SLO holds. From a sweep:

1. judge every step again with the planner's SLO, from the step's own p90 TTFT and TPOT (the
   sweep's `slo_met` may be against another SLO) and its error rate;
2. take the passing step with the highest achieved `request_rps`;
3. interpolate toward the nearest failing step above it: along the straight line between the two
   steps, the rate at which the first of the failing metrics crosses its target;
4. divide by `hardware.replicas` (the sweep may have driven several replicas behind one gateway).

`hardware.gpu` and `hardware.tp` (or `GPU:TP=path` on the command line) say which plan row the
table replaces. Pure: takes the parsed JSON, returns numbers and warnings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tools.capacity.plan.model import Slo

SCHEMA = "inferbus.capacity.sweep/v1"
MAX_ERROR_RATE = 0.001  # a step failing more requests than this is not served (`inferbus sweep`'s threshold)
MIX_TOLERANCE = 0.10  # warn when a mean differs from the plan's mix by more than this


class SweepError(ValueError):
    """A sweep file that cannot be used; the message says what is missing."""


@dataclass(frozen=True)
class SweepStep:
    load: float  # concurrency or offered rate, in sweep order
    request_rps: float
    ttft_p90_s: float
    tpot_p90_s: float
    requests: int
    errors: int
    client_limited: bool

    def failures(self, slo: Slo) -> list[str]:
        """Which targets this step misses under `slo` ("errors" when too many requests failed)."""
        missed = []
        if not self.ttft_p90_s <= slo.ttft_p90_s:
            missed.append("TTFT")
        if not self.tpot_p90_s <= slo.tpot_p90_s:
            missed.append("TPOT")
        if self.requests and self.errors / self.requests > MAX_ERROR_RATE:
            missed.append("errors")
        return missed


@dataclass(frozen=True)
class Sweep:
    source: str
    gpu: str | None
    tp: int | None
    replicas: int
    mode: str
    mix: Mapping[str, Any]
    steps: tuple[SweepStep, ...]


@dataclass(frozen=True)
class SweepGoodput:
    source: str
    gpu: str
    tp: int
    rps: float  # per replica
    binding: str | None  # the metric that fails first above the goodput; None if the sweep never failed
    passing_rps: float | None  # per replica, the best passing step
    failing_rps: float | None  # per replica, the failing step it interpolates toward
    points: tuple[tuple[float, float, float], ...]  # per replica (rate, TTFT p90 s, TPOT p90 s), for plots
    replicas: int = 1  # replicas the sweep drove (its rates are divided by this)
    # The binding metric at the passing and the failing step, its target, and how far between the
    # two steps it crosses the target (0–1): what the report shows of the interpolation.
    crossing: tuple[float, float, float, float] | None = None
    warnings: tuple[str, ...] = field(default=())
    infeasible: str | None = None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SweepError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _p90(step: Mapping[str, Any], name: str, where: str, missing: float) -> float:
    """The step's p90 of `name`; `missing` when it measured none (null or NaN)."""
    block = step.get(name)
    if not isinstance(block, Mapping) or "p90" not in block:
        raise SweepError(f"{where}: missing {name}.p90")
    value = block["p90"]
    if value is None:
        return missing
    value = _number(value, f"{where} {name}.p90")
    return missing if math.isnan(value) else value


def parse(data: Any, source: str, gpu: str | None = None, tp: int | None = None) -> Sweep:
    """A sweep from its parsed JSON; `gpu`/`tp` override (or fill in) the file's hardware."""
    if not isinstance(data, Mapping):
        raise SweepError(f"{source}: a sweep result is a JSON object")
    schema = data.get("schema")
    if schema not in (None, SCHEMA):
        raise SweepError(f"{source}: schema {schema!r} is not {SCHEMA}")
    hardware = data.get("hardware") or {}
    if not isinstance(hardware, Mapping):
        raise SweepError(f"{source}: `hardware` must be an object")
    gpu = gpu or hardware.get("gpu")
    tp = tp or hardware.get("tp")
    replicas = hardware.get("replicas") or 1
    if not isinstance(replicas, int) or replicas < 1:
        raise SweepError(f"{source}: hardware.replicas must be a positive integer, got {replicas!r}")
    raw_steps = data.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise SweepError(f"{source}: no `steps`")
    mode = str(data.get("mode") or "concurrency")
    steps = []
    for i, raw in enumerate(raw_steps):
        where = f"{source}: steps[{i}]"
        if not isinstance(raw, Mapping):
            raise SweepError(f"{where}: expected an object")
        if "request_rps" not in raw:
            raise SweepError(f"{where}: missing request_rps")
        load = raw.get("concurrency") if mode == "concurrency" else raw.get("rate_rps")
        completed = int(raw.get("completed") or 0) if "completed" in raw else None
        served = completed is None or completed > 0
        steps.append(SweepStep(
            load=_number(load if load is not None else i, f"{where} load"),
            request_rps=_number(raw["request_rps"], f"{where} request_rps"),
            # No TTFT means nothing completed: a failure. No TPOT with completions means one-token
            # answers: nothing to judge (as `inferbus sweep` does).
            ttft_p90_s=_p90(raw, "ttft_s", where, math.inf),
            tpot_p90_s=_p90(raw, "tpot_s", where, 0.0 if served else math.inf),
            requests=int(raw.get("requests") or raw.get("completed") or 0),
            errors=int(raw.get("errors") or 0),
            client_limited=bool(raw.get("client_limited", False)),
        ))
    raw_mix = data.get("mix")
    mix: Mapping[str, Any] = raw_mix if isinstance(raw_mix, Mapping) else {}
    return Sweep(source, str(gpu) if gpu else None, int(tp) if tp else None, replicas, mode, mix, tuple(steps))


def mix_warnings(sweep_mix: Mapping[str, Any], plan_mix: Mapping[str, Any]) -> list[str]:
    """Warnings when the sweep ran another mix than the plan's (compared by their means)."""
    if not sweep_mix:
        return ["the sweep does not record its mix: cannot check it matches the plan's"]
    differ = []
    for key in ("mean_input_tokens", "mean_output_tokens", "mean_cached_tokens"):
        theirs, ours = sweep_mix.get(key), plan_mix.get(key)
        if not isinstance(theirs, int | float) or not isinstance(ours, int | float):
            continue
        if abs(theirs - ours) > MIX_TOLERANCE * max(abs(ours), 1.0):
            differ.append(f"{key} {theirs:g} vs {ours:g}")
    return (
        [f"the sweep ran another mix than the plan's ({', '.join(differ)}): its goodput is for that mix"]
        if differ
        else []
    )


def goodput(sweep: Sweep, slo: Slo, plan_mix: Mapping[str, Any]) -> SweepGoodput:
    """Per-replica goodput under `slo` (see the module docstring)."""
    if not sweep.gpu or not sweep.tp:
        raise SweepError(f"{sweep.source}: the sweep does not say which GPU and TP it ran on; "
                         "pass it as GPU:TP=PATH, e.g. --sweep H100:2=results.json")
    n = sweep.replicas
    warnings = mix_warnings(sweep.mix, plan_mix)
    limited = [s for s in sweep.steps if s.client_limited]
    if limited:
        loads = ", ".join(f"{s.load:g}" for s in limited)
        warnings.append(f"the load generator was the bottleneck at {sweep.mode} {loads}: "
                        "those steps understate what the server can do")
    ordered = sorted(sweep.steps, key=lambda s: s.request_rps)
    points = tuple((s.request_rps / n, s.ttft_p90_s, s.tpot_p90_s) for s in ordered)
    passing = [s for s in ordered if not s.failures(slo)]
    # The fields every answer below shares.
    result = partial(SweepGoodput, source=sweep.source, gpu=sweep.gpu, tp=sweep.tp, points=points, replicas=n)
    if not passing:
        return result(rps=0.0, binding=None, passing_rps=None, failing_rps=None, warnings=tuple(warnings),
                            infeasible="no sweep step met the SLO")
    best = passing[-1]
    above = [s for s in ordered if s.request_rps > best.request_rps and s.failures(slo)]
    if not above:
        warnings.append("no step above the best passing one failed the SLO: the goodput is a lower bound "
                        "(sweep to higher load)")
        return result(rps=best.request_rps / n, binding=None, passing_rps=best.request_rps / n,
                            failing_rps=None, warnings=tuple(warnings))
    fail = above[0]
    # Where along best → fail each missed metric crosses its target; the first crossing binds.
    values = {
        "TTFT": (best.ttft_p90_s, fail.ttft_p90_s, slo.ttft_p90_s),
        "TPOT": (best.tpot_p90_s, fail.tpot_p90_s, slo.tpot_p90_s),
    }
    crossings = {}
    for metric in fail.failures(slo):
        # errors: no interpolation, stop at the passing step
        crossings[metric] = _fraction(*values[metric]) if metric in values else 0.0
    binding = min(crossings, key=lambda m: crossings[m])
    rps = best.request_rps + crossings[binding] * (fail.request_rps - best.request_rps)
    crossing = (*values[binding], crossings[binding]) if binding in values else None
    return result(rps=rps / n, binding=binding, passing_rps=best.request_rps / n,
                        failing_rps=fail.request_rps / n, crossing=crossing, warnings=tuple(warnings))


def _fraction(passing: float, failing: float, target: float) -> float:
    if math.isinf(failing) or failing <= passing:
        return 0.0
    return min(1.0, max(0.0, (target - passing) / (failing - passing)))
