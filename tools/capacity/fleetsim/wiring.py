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
  through the loop's `FleetControls`, which both loops implement with one `Lifecycle` (start,
  promote, drain, stop warm replicas), each supplying how its replicas are made, timed and stopped;
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

from proto import messages as m
from services.gateway.overload import OverloadPolicy
from services.router.config import RoutingConfig
from services.router.placement import Placer, make_placer
from tools.capacity.fleetsim.sampler import LoadSampler
from tools.capacity.fleetsim.timeseries import Bucket, quantile


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


class Lifecycle:
    """The fleet's controls (`FleetControls`) and a replica's lifecycle, the same in both loops:
    starting (cold start) → serving, or → warm (loaded, not serving) → promoted (warm start) →
    serving → draining (no new work, finishes its own) → stopped, or back to warm.

    `nodes` is the loop's replicas not stopped (each with `name`, `state`, `warm_target` and
    `in_flight`); the loop supplies what differs between its replica models:
    `new_replica()` (a billed replica in state "starting"), `after(delay_s, node)` (call `ready(node)`
    that much later), `serve(node)`, `begin_drain(node)` (stop placing on a replica just marked
    draining; then `drained(node)` once it holds nothing), `park(node)` (a drained replica that
    went back to the warm pool leaves the router's registry) and `stop(node)`. Controls are rare
    (a controller's interval), so calling through here costs the compiled loop nothing measurable."""

    def __init__(self, nodes: dict[str, Any], *, cold_start_s: float, warm_start_s: float,
                 new_replica: Callable[[], Any], after: Callable[[float, Any], None], serve: Callable[[Any], None],
                 begin_drain: Callable[[Any], None], park: Callable[[Any], None],
                 stop: Callable[[Any], None]) -> None:
        self.nodes = nodes
        self.cold_start_s = cold_start_s
        self.warm_start_s = warm_start_s
        self._new_replica = new_replica
        self._after = after
        self._serve = serve
        self._begin_drain = begin_drain
        self._park = park
        self._stop = stop

    def start(self, count: int = 1, *, warm: bool = False) -> list[str]:
        """Cold-start `count` replicas; serving (or, with `warm`, warm) after `cold_start_s`."""
        names = []
        for _ in range(max(0, count)):
            node = self._new_replica()
            node.warm_target = warm
            self._after(self.cold_start_s, node)
            names.append(node.name)
        return names

    def promote(self, count: int = 1, ids: list[str] | None = None) -> list[str]:
        """Warm replicas (`ids`, else the first `count`) serve after `warm_start_s` (billed all along)."""
        names = []
        for node in pick(self.nodes, "warm", count, ids):
            node.state = "starting"
            node.warm_target = False
            self._after(self.warm_start_s, node)
            names.append(node.name)
        return names

    def drain(self, count: int = 1, ids: list[str] | None = None, *, to_warm: bool = False) -> list[str]:
        """Serving replicas (`ids`, else the `count` least busy) take no new work, finish their
        own, then stop (or, with `to_warm`, go back to the warm pool, engine kept)."""
        if ids is None:
            serving = sorted(pick(self.nodes, "serving", len(self.nodes), None), key=lambda node: node.in_flight)
            chosen = serving[: max(0, count)]
        else:
            chosen = pick(self.nodes, "serving", count, ids)
        for node in chosen:
            node.state = "draining"
            node.warm_target = to_warm
            self._begin_drain(node)
        return [node.name for node in chosen]

    def stop_warm(self, count: int = 1, ids: list[str] | None = None) -> list[str]:
        """Stop warm replicas (`ids`, else the first `count`)."""
        chosen = pick(self.nodes, "warm", count, ids)
        for node in chosen:
            self._stop(node)
        return [node.name for node in chosen]

    def ready(self, node: Any) -> None:
        """A start or promotion is done: the replica serves, or joins the warm pool."""
        if node.state != "starting":
            return
        if node.warm_target:
            node.state = "warm"
            node.warm_target = False
        else:
            self._serve(node)

    def drained(self, node: Any) -> None:
        """A draining replica holds nothing more: it stops, or goes back to the warm pool."""
        if not node.warm_target:
            self._stop(node)
            return
        node.state = "warm"
        node.warm_target = False
        self._park(node)


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
