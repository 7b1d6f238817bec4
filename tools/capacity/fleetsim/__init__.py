"""Discrete-event fleet simulator: traces replayed through the router's placement policy onto
simulated engines, on a virtual clock (no real time, no network).

    from tools.capacity import traces
    from tools.capacity.fleetsim import FleetConfig, FleetSim, capacity, workload

    trace = traces.load("mooncake_synthetic.jsonl")
    rate = capacity.rate_for_load(trace, FleetConfig().engine, replicas=8, load=0.8)
    report = FleetSim(FleetConfig(replicas=8, policy="affinity"), workload.at_rate(trace, rate)).run()
    print(report.hit_rate, report.ttft_p90_s, report.cpu_s)

Modules: `events` (the event loop), `fleet` (replicas, router wiring, failures), `batch` (a
batch band beside the trace: the batch service's feed policy and the workers' preemption policy,
`FleetSim(config, trace, batch=BatchSpec(...))`), `workload` (token ids from trace block ids,
synthetic traces, rate scaling), `capacity` (perf-model load sizing), `report` (metrics and tables).
`wiring` builds the production decisions both simulators run (placement, admission, the
controller's signals) and names what they read of a replica (`ReplicaModel`); `sampler` draws the
router's placement of load-only requests in O(√n).

The fast simulator behind `inferbus simulate` (docs/simulator.md): `analytic` (an engine replica
advanced a few events per request), `fast` (the fleet loop, the placement and admission
policies, the controller hook), `day` (a trace's rate shape over a day, scaled to a peak),
`timeseries` (per-minute metrics, SLO attainment, plots), the command is `tools.commands.simulate`.
`tools.capacity.accel` puts mypyc builds of `analytic` and `fast` ahead of them while the builds match
these sources.
"""

from __future__ import annotations

from tools.capacity import accel

accel.activate(__path__)  # the compiled `analytic` and `fast`, when built from these very sources

from tools.capacity.fleetsim import capacity, workload  # noqa: E402
from tools.capacity.fleetsim.batch import BatchReport, BatchSpec, LineLengths  # noqa: E402
from tools.capacity.fleetsim.events import EventLoop  # noqa: E402
from tools.capacity.fleetsim.fast import FastConfig, FastFleet, FleetSignals, StaticController  # noqa: E402
from tools.capacity.fleetsim.fleet import FleetSim, simulate  # noqa: E402
from tools.capacity.fleetsim.report import RunReport, markdown_table, percentile  # noqa: E402
from tools.capacity.fleetsim.state import FleetConfig, Job, Replica  # noqa: E402

__all__ = [
    "BatchReport",
    "BatchSpec",
    "EventLoop",
    "LineLengths",
    "FastConfig",
    "FastFleet",
    "FleetConfig",
    "FleetSignals",
    "FleetSim",
    "Job",
    "Replica",
    "RunReport",
    "StaticController",
    "capacity",
    "markdown_table",
    "percentile",
    "simulate",
    "workload",
]
