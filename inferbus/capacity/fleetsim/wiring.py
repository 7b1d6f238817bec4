"""The production decisions the fleet simulators run, wired once for both loops.

There are two loops because of speed: `fleet.FleetSim` steps the simulated engine's real
scheduler (prefix cache, chunked prefill, one event per GPU step), and `fast.FastFleet` advances
analytic replicas a few events per request, compiled with mypyc, to simulate a day of traffic at
50,000+ requests per CPU-second. What decides is the same production code in both, built here:

- placement: `make_placement`, the router's `Placer` (worker registry and policy), with the
  simulator's `LoadSampler` in front of it where requests are load-only;
- admission: `Admission`, the gateway's `OverloadPolicy` fed the workers' load reports;
- scaling: a `Controller` (the autoscaler's policy, `services.autoscaler.simulated`) called every
  `interval_s` with `FleetSignals` built by `fleet_signals` from either replica model, acting
  through the loop's `FleetControls`;
- the batch band (the batch service's feed, the workers' preemption tick): `batch.BatchBand`,
  which needs the per-step engine (it preempts and resumes engine requests).

Each loop's replicas are a `ReplicaModel`: `fleet.Replica` (the per-step engine) and
`analytic.AnalyticReplica`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from inferbus.capacity.fleetsim.sampler import LoadSampler
from inferbus.capacity.fleetsim.timeseries import Bucket, quantile
from proto import messages as m
from services.gateway.overload import OverloadPolicy
from services.router.config import RoutingConfig
from services.router.placement import Placer, make_placer


class ReplicaModel(Protocol):
    """What the wiring reads of a replica, whichever model serves it."""

    @property
    def name(self) -> str: ...

    @property
    def kv_capacity(self) -> int: ...

    @property
    def running(self) -> int: ...  # requests in the engine's batch (prefilling or decoding)

    @property
    def in_flight(self) -> int: ...  # running and waiting in the engine

    @property
    def waiting(self) -> Collection[Any]: ...  # waiting in the engine

    def kv_used(self) -> int: ...

    def queued_prefill(self) -> int: ...  # prompt tokens taken, not yet prefilled


# ---- placement -------------------------------------------------------------------------------


def make_placement(policy: str, routing: RoutingConfig | None, block_size: int, clock: Callable[[], float],
                   seed: int, *, sampler: bool = False) -> tuple[Placer, LoadSampler | None]:
    """The router's placement as the simulators run it: `routing` None is its defaults at the
    engine's block size; `sampler` puts a `LoadSampler` in front (the same choices, faster)."""
    placer = make_placer(policy, clock=clock, config=routing or RoutingConfig(block_size=block_size),
                         rng=random.Random(seed))
    return placer, LoadSampler(placer) if sampler else None


# ---- admission -------------------------------------------------------------------------------


class Admission:
    """The gateway's overload policy: sheds a standard-band request whose expected wait exceeds
    the band's budget. Its inputs change only when load reports arrive, so its verdict is
    re-evaluated every `refresh_s` rather than per request (`ok` until `until`)."""

    def __init__(self, clock: Callable[[], float], budget_s: float = 3.0, refresh_s: float = 0.25) -> None:
        self.policy = OverloadPolicy(clock=clock, budgets_s={"premium": 10.0, "standard": budget_s})
        self.refresh_s = refresh_s
        self.ok = True
        self.until = -1.0

    def on_load(self, load: m.WorkerLoad) -> None:
        self.policy.on_load(load)

    def admitted(self, t: float) -> bool:
        if t >= self.until:
            self.ok = self.policy.admit("standard").admitted
            self.until = t + self.refresh_s
        return self.ok


# ---- scaling ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetSignals:
    """What a controller sees every `interval_s` (windowed values over the last interval)."""

    t: float
    window_s: float
    arrivals: int
    arrival_rps: float
    rejected: int
    completed: int
    ttft_p90_s: float  # NaN when nothing finished in the window
    tpot_p90_s: float
    queue_wait_p90_s: float  # arrival → prefill start
    kv_use_mean: float  # over serving replicas, now
    kv_use_max: float
    running: tuple[int, ...]  # per serving replica, now (in `serving_ids` order)
    waiting: tuple[int, ...]
    in_flight: int  # requests held by serving and draining replicas (running + waiting)
    queued_prefill_tokens: int
    serving: int
    warm: int
    starting: int  # cold starts and promotions in progress
    draining: int
    serving_ids: tuple[str, ...] = ()  # least busy first (cheapest to drain)
    warm_ids: tuple[str, ...] = ()


class FleetControls(Protocol):
    """How a controller changes a fleet (both loops have these). `nodes`: every replica not
    stopped, each with a `state` (starting | warm | serving | draining) and `warm_target` (a
    start that ends in the warm pool)."""

    nodes: dict[str, Any]

    def start(self, count: int = 1, *, warm: bool = False) -> list[str]: ...
    def promote(self, count: int = 1, ids: list[str] | None = None) -> list[str]: ...
    def drain(self, count: int = 1, ids: list[str] | None = None, *, to_warm: bool = False) -> list[str]: ...
    def stop_warm(self, count: int = 1, ids: list[str] | None = None) -> list[str]: ...


class Controller(Protocol):
    interval_s: float

    def decide(self, signals: FleetSignals, fleet: Any) -> None: ...


@dataclass
class StaticController:
    """A fixed fleet: never changes anything."""

    interval_s: float = 60.0

    def decide(self, signals: FleetSignals, fleet: Any) -> None:
        return None


def fleet_states(nodes: Iterable[Any]) -> dict[str, int]:
    """Replicas per lifecycle state."""
    out = {"starting": 0, "warm": 0, "serving": 0, "draining": 0}
    for node in nodes:
        if node.state in out:
            out[node.state] += 1
    return out


def pick(nodes: dict[str, Any], state: str, count: int, ids: list[str] | None) -> list[Any]:
    """The replicas a control acts on: those of `ids` in `state`, else the first `count` in it."""
    if ids is not None:
        return [nodes[i] for i in ids if i in nodes and nodes[i].state == state]
    return [node for node in nodes.values() if node.state == state][: max(0, count)]


def fleet_signals(t: float, window: Bucket, window_start: float, serving: Iterable[ReplicaModel],
                  states: dict[str, int], held: int, warm_ids: Iterable[str]) -> FleetSignals:
    """The signals of one controller interval: `window` collected since `window_start`, the
    serving replicas now, `held` requests in serving and draining replicas and the shared queue."""
    span = max(1e-9, t - window_start)
    replicas = sorted(serving, key=lambda r: r.in_flight)
    kv = [min(1.0, r.kv_used() / r.kv_capacity) for r in replicas] or [0.0]
    return FleetSignals(
        t=t, window_s=span, arrivals=window.arrivals, arrival_rps=window.arrivals / span,
        rejected=window.rejected, completed=len(window.ttft), ttft_p90_s=quantile(window.ttft, 0.9),
        tpot_p90_s=quantile(window.tpot, 0.9), queue_wait_p90_s=quantile(window.wait, 0.9),
        kv_use_mean=sum(kv) / len(kv), kv_use_max=max(kv),
        running=tuple(r.running for r in replicas), waiting=tuple(len(r.waiting) for r in replicas),
        in_flight=held, queued_prefill_tokens=sum(r.queued_prefill() for r in replicas),
        serving=states["serving"], warm=states["warm"], starting=states["starting"], draining=states["draining"],
        serving_ids=tuple(r.name for r in replicas), warm_ids=tuple(warm_ids),
    )
