"""Discrete-event fleet simulator: traces replayed through the router's placement policy onto
simulated engines, on a virtual clock (no real time, no network).

    from inferbus import traces
    from inferbus.fleetsim import FleetConfig, FleetSim, capacity, workload

    trace = traces.load("mooncake_synthetic.jsonl")
    rate = capacity.rate_for_load(trace, FleetConfig().engine, replicas=8, load=0.8)
    report = FleetSim(FleetConfig(replicas=8, policy="affinity"), workload.at_rate(trace, rate)).run()
    print(report.hit_rate, report.ttft_p90_s, report.cpu_s)

Modules: `events` (the event loop), `fleet` (replicas, router wiring, failures), `workload`
(token ids from trace block ids, synthetic traces, rate scaling), `capacity` (perf-model load
sizing), `report` (metrics and tables).
"""

from __future__ import annotations

from . import capacity, workload
from .events import EventLoop
from .fleet import FleetConfig, FleetSim, Job, Replica, simulate
from .report import RunReport, markdown_table, percentile

__all__ = [
    "EventLoop", "FleetConfig", "FleetSim", "Job", "Replica", "RunReport", "capacity", "markdown_table",
    "percentile", "simulate", "workload",
]
