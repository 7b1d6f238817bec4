"""What a fleet run measured, as one flat record per run, plus a markdown table of several runs.

- Hit rate: token-weighted and engine-reported: Σ cached prompt tokens / Σ prompt tokens over
  every engine (attempts included), i.e. what `usage.prompt_tokens_details.cached_tokens` would
  add up to.
- TTFT: first token − arrival at the gateway (a migrated request keeps its first attempt's
  first token). TPOT: (finish − first token) / (output tokens − 1), per request with ≥ 2 tokens.
  Percentiles by nearest rank over completed requests.
- Throughput over the makespan, from the first arrival to the last finish.
- Imbalance: max / mean of per-replica processed tokens (prompt tokens prefilled + output tokens
  generated). Utilisation: mean fraction of the makespan a replica's engine spent in steps.
- Simulator speed: CPU seconds (`time.process_time`) of `run()`, requests per CPU second, events
  per CPU second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tools.capacity.fleetsim.batch import BatchBand, BatchReport
from tools.capacity.fleetsim.events import EventLoop
from tools.capacity.fleetsim.state import Job, Replica
from tools.capacity.stats import percentile


class Simulated(Protocol):
    """What a report reads of a finished run (`fleet.FleetSim`)."""

    policy_name: str
    migrations: int
    recovered_queued: int
    shared_placements: int
    resyncs: int
    placement_s: float
    stalled: bool

    @property
    def jobs(self) -> Sequence[Job]: ...

    @property
    def replicas(self) -> Sequence[Replica]: ...

    @property
    def loop(self) -> EventLoop: ...

    @property
    def band(self) -> BatchBand | None: ...


@dataclass
class RunReport:
    policy: str
    replicas: int
    requests: int
    completed: int
    failed: int
    unfinished: int
    offered_rps: float
    makespan_s: float
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    e2e_p50_s: float
    output_tok_s: float
    completed_rps: float
    imbalance: float
    utilisation: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    output_tokens: int
    preemptions: int
    migrations: int
    recovered_queued: int
    shared_placements: int
    resyncs: int
    steps: int
    events: int
    cpu_s: float
    wall_s: float
    placement_cpu_s: float
    req_per_cpu_s: float
    events_per_cpu_s: float
    stalled: bool = False
    rejected: int = 0  # shed by the gateway's overload policy (`FleetConfig.admission`)
    batch: BatchReport | None = None  # with a batch band (fleet.FleetSim(batch=...)); the rest is interactive only

    def as_dict(self) -> dict[str, Any]:
        return {key: _clean(value) for key, value in asdict(self).items()}


def _clean(value: Any) -> Any:
    """NaN → None (JSON has no NaN), in nested records too."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    return value


def _ended(replica: Replica, last_finish: float) -> float:
    """When the replica stopped serving: killed, stopped by a controller, or the run's end."""
    for ended in (replica.died_s, replica.stopped_s):
        if ended is not None:
            return float(ended)
    return last_finish


def build_report(sim: Simulated, *, cpu_s: float, wall_s: float) -> RunReport:
    jobs = sim.jobs
    completed = [job for job in jobs if job.status == "completed"]
    failed = sum(job.status == "failed" for job in jobs)
    unfinished = sum(job.status == "pending" for job in jobs)
    rejected = sum(job.status == "rejected" for job in jobs)
    ttfts = [job.first_token_s - job.arrival_s for job in completed if job.first_token_s is not None]
    tpots = [
        (job.finish_s - job.first_token_s) / (job.delivered - 1)
        for job in completed
        if job.first_token_s is not None and job.finish_s is not None and job.delivered > 1
    ]
    e2es = [job.finish_s - job.arrival_s for job in completed if job.finish_s is not None]
    first_arrival = jobs[0].arrival_s if jobs else 0.0
    last_finish = max((job.finish_s for job in jobs if job.finish_s is not None), default=first_arrival)
    makespan = max(last_finish - first_arrival, 1e-9)
    replicas = sim.replicas
    engines = [replica.engine for replica in replicas]
    prompt_tokens = sum(engine.prompt_tokens_total for engine in engines)
    cached_tokens = sum(engine.cached_tokens_total for engine in engines)
    output_tokens = sum(job.delivered for job in completed)
    processed = [replica.processed_tokens for replica in replicas if replica.steps or replica.alive]
    mean_processed = sum(processed) / len(processed) if processed else 0.0
    utilisation = [
        replica.busy_s / max(1e-9, (_ended(replica, last_finish) - replica.started_s))
        for replica in replicas
    ]
    span = (jobs[-1].arrival_s - first_arrival) if len(jobs) > 1 else 0.0
    events = sim.loop.events_run
    return RunReport(
        policy=sim.policy_name,
        replicas=len(replicas),
        requests=len(jobs),
        completed=len(completed),
        failed=failed,
        unfinished=unfinished,
        offered_rps=(len(jobs) - 1) / span if span > 0 else float("nan"),
        makespan_s=makespan,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        tpot_p50_s=percentile(tpots, 50),
        tpot_p90_s=percentile(tpots, 90),
        e2e_p50_s=percentile(e2es, 50),
        output_tok_s=output_tokens / makespan,
        completed_rps=len(completed) / makespan,
        imbalance=max(processed) / mean_processed if mean_processed else float("nan"),
        utilisation=sum(utilisation) / len(utilisation) if utilisation else 0.0,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        prefill_tokens=sum(replica.prefill_tokens for replica in replicas),
        output_tokens=output_tokens,
        preemptions=sum(engine.preemptions_total for engine in engines),
        migrations=sim.migrations,
        recovered_queued=sim.recovered_queued,
        shared_placements=sim.shared_placements,
        resyncs=sim.resyncs,
        steps=sum(replica.steps for replica in replicas),
        events=events,
        cpu_s=cpu_s,
        wall_s=wall_s,
        placement_cpu_s=sim.placement_s,
        req_per_cpu_s=len(jobs) / cpu_s if cpu_s > 0 else float("inf"),
        events_per_cpu_s=events / cpu_s if cpu_s > 0 else float("inf"),
        stalled=sim.stalled,
        rejected=rejected,
        batch=sim.band.report() if sim.band is not None else None,
    )


def _ms(value: float | None) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1000:,.0f}"


def markdown_table(reports: list[RunReport] | list[dict[str, Any]]) -> str:
    """One row per run: routing quality, latency, throughput and simulator cost."""
    rows = [r.as_dict() if isinstance(r, RunReport) else r for r in reports]
    lines = [
        "| policy | replicas | offered req/s | hit rate | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms "
        "| output tok/s | req/s | imbalance | utilisation | done / failed / unfinished | CPU s | req/CPU-s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['replicas']} | {r['offered_rps'] or 0:,.1f} | {r['hit_rate']:.1%} "
            f"| {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} / {_ms(r['ttft_p99_s'])} "
            f"| {_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p90_s'])} "
            f"| {r['output_tok_s']:,.0f} | {r['completed_rps']:,.2f} | {r['imbalance'] or 0:.2f} "
            f"| {r['utilisation']:.0%} | {r['completed']} / {r['failed']} / {r['unfinished']} "
            f"| {r['cpu_s']:.1f} | {r['req_per_cpu_s']:,.0f} |"
        )
    return "\n".join(lines) + "\n"
