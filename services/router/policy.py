"""Placement policies: pure, with an injected clock and random source, so the router service, unit
tests and the discrete-event fleet simulator run the same code.

Every policy keeps the same worker registry (heartbeats, load reports, the router's own and its
replicas' placements) and applies the same hard filters: alive, serving the model, not draining,
KV cache below a ceiling, and able to serve the request's LoRA adapter. They differ in how they
choose among the survivors:

- `round_robin`: in turn (a baseline).
- `least_loaded`: the fewest requests per slot, counting placements made since the last report
  (reports lag by up to one interval).
- `affinity` (the default): the lowest estimated time to first token,

      cost = (queued prefill tokens + miss_weight · prompt tokens not cached there) / prefill rate
             + decode_weight · running / slots
             + adapter_load_s · [adapter not loaded there],

  `miss_weight` (5) > 1 because recomputing a prefix costs the whole fleet GPU time, not only this
  request its wait: the work it adds delays everything queued behind it.

  with a softmax at a small temperature over the cost so that several router replicas, or bursts
  within one report interval, do not all land on one worker. A hot prefix spills to the next-best
  worker by itself: each placement adds its prefill to the chosen worker's queue until another
  worker, even without the prefix, becomes cheaper, and that worker then caches it too.
"""

from __future__ import annotations

import abc
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from inferbus.tokens import DEFAULT_BLOCK_SIZE
from proto import messages as m
from proto import subjects

from .index import PrefixIndex

PolicyName = Literal["affinity", "least_loaded", "round_robin"]
POLICY_NAMES: tuple[PolicyName, ...] = ("affinity", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    heartbeat_ttl_s: float = 3.0
    kv_ceiling: float = 0.95
    # Softmax temperature, in the cost's unit (seconds for affinity, requests per slot for
    # least-loaded): choices within about this much of the best share the traffic.
    temperature: float = 0.02
    # Prompt tokens one worker prefills per second: turns tokens into seconds of queueing. It only
    # needs to be about right; the ranking of workers does not depend on its exact value much.
    prefill_tokens_per_s: float = 10_000.0
    # Weight of this request's own uncached prefill against queued work. Recomputing a prefix delays
    # not only this request but every request queued behind it on that worker; at the ~80% load a
    # fleet is sized for, that displaced work is worth about 1/(1-ρ) ≈ 5 times the request's own
    # wait. In the fleet simulator on the Mooncake trace, 4-10 all beat 1.5 clearly (docs/routing.md).
    miss_weight: float = 5.0
    decode_weight_s: float = 0.25  # cost of a worker whose every slot is decoding
    adapter_load_s: float = 0.5  # cost of loading an adapter that is not on the worker yet
    index_blocks_per_worker: int = 250_000
    index_ttl_s: float = 900.0


@dataclass
class WorkerView:
    worker_id: str
    model: str
    last_seen: float
    max_running: int = 1
    draining: bool = False
    block_size: int = 0
    max_adapters: int = 0
    adapters: frozenset[str] = frozenset()
    reported_load: int = 0  # running + waiting in the engine at the last report
    reported_prefill: int = 0  # prompt tokens taken by the worker, not yet prefilled, at the last report
    running: int = 0
    kv_usage: float = 0.0
    # Placements (by any router replica) against what the worker reports it pulled from its own
    # queue: the difference still waits in that queue, where no engine number shows it.
    placed_total: int = 0
    pulled_own: int = 0
    pulled_offset: int | None = None  # pulled_own when this router first heard from the worker
    # Running total of prefill tokens placed here, one entry per recent placement, so the prefill
    # of the last n placements is a subtraction.
    placed_prefill: deque[int] = field(default_factory=lambda: deque([0], maxlen=4097))
    # Wait this worker adds to any request, in seconds (queued prefill and load), kept current on
    # every event that changes it so that a placement only adds the request's own part.
    base_cost: float = 0.0

    def backlog(self) -> int:
        pulled = self.pulled_own - (self.pulled_offset or 0)
        return max(0, self.placed_total - pulled)

    def backlog_prefill(self, backlog: int) -> int:
        if not backlog:
            return 0
        totals = self.placed_prefill
        return totals[-1] - totals[-1 - min(backlog, len(totals) - 1)]


@dataclass
class Policy(abc.ABC):
    """The registry and filters every policy shares; subclasses choose among the candidates."""

    clock: Callable[[], float]
    config: RoutingConfig = field(default_factory=RoutingConfig)
    rng: random.Random = field(default_factory=random.Random)
    workers: dict[str, WorkerView] = field(default_factory=dict)
    index: PrefixIndex = field(init=False)

    name = "base"

    def __post_init__(self) -> None:
        self.index = PrefixIndex(
            max_blocks_per_worker=self.config.index_blocks_per_worker, ttl_s=self.config.index_ttl_s
        )
        # model → workers passing the filters that only events change: not draining (`_serving`),
        # and also below the KV ceiling (`_eligible`); liveness, which time changes, is checked
        # per placement.
        self._serving: dict[str, dict[str, WorkerView]] = {}
        self._eligible: dict[str, dict[str, WorkerView]] = {}

    def _refresh(self, view: WorkerView) -> None:
        """Re-apply the event-driven filters and recompute the worker's base cost."""
        for pool, excluded in (
            (self._serving.setdefault(view.model, {}), view.draining),
            (self._eligible.setdefault(view.model, {}), view.draining or view.kv_usage >= self.config.kv_ceiling),
        ):
            if excluded:
                pool.pop(view.worker_id, None)
            else:
                pool[view.worker_id] = view
        config = self.config
        backlog = view.backlog()
        queued = view.reported_prefill + view.backlog_prefill(backlog)
        view.base_cost = (queued / config.prefill_tokens_per_s
                          + config.decode_weight_s * (view.reported_load + backlog) / view.max_running)

    # ---- events ------------------------------------------------------------------------------

    def on_heartbeat(self, beat: m.Heartbeat) -> None:
        view = self.workers.get(beat.worker_id)
        if view is None:
            view = self.workers[beat.worker_id] = WorkerView(beat.worker_id, beat.model, self.clock())
        view.last_seen = self.clock()
        view.max_running = max(1, beat.max_running)
        view.draining = beat.state == "draining"
        view.block_size = beat.block_size
        view.max_adapters = beat.max_adapters
        view.adapters = frozenset(beat.adapters)
        self._refresh(view)

    def on_worker_gone(self, worker_id: str) -> None:
        view = self.workers.pop(worker_id, None)
        if view is not None:
            self._serving.get(view.model, {}).pop(worker_id, None)
            self._eligible.get(view.model, {}).pop(worker_id, None)
        self.index.forget(worker_id)

    def on_load(self, load: m.WorkerLoad) -> None:
        view = self.workers.get(load.worker_id)
        if view is None:
            return
        view.reported_load = load.running + load.waiting
        view.reported_prefill = load.queued_prefill_tokens
        view.running = load.running
        if view.pulled_offset is None:
            # First report: assume what was placed so far has been pulled.
            view.pulled_offset = load.pulled_own - view.placed_total
        view.pulled_own = load.pulled_own
        view.draining = load.draining
        view.adapters = frozenset(load.adapters) if load.adapters else view.adapters
        view.kv_usage = load.kv_used_tokens / load.kv_capacity_tokens if load.kv_capacity_tokens else 0.0
        self._refresh(view)

    def on_cache(self, event: m.CacheEvent) -> bool:
        """Apply a worker's cache event. False: events were missed, ask the worker to resync."""
        if event.worker_id not in self.workers:
            return True  # not registered yet (its heartbeat follows); the resync on register covers it
        snapshot = event.cleared
        in_order = self.index.check_seq(event.worker_id, event.seq, snapshot)
        if snapshot:
            self.index.clear_blocks(event.worker_id)
        now = self.clock()
        for stored in event.stored:
            self.index.add(event.worker_id, stored.block_hashes, now)
        if event.removed:
            self.index.remove(event.worker_id, event.removed)
        return in_order

    def on_placed(self, placed: m.Placed) -> None:
        """A placement made by another router replica."""
        view = self.workers.get(placed.worker_id)
        if view is not None:
            self._count(view, placed.prefill_tokens, placed.block_hashes)

    def alive(self, view: WorkerView) -> bool:
        return self.clock() - view.last_seen <= self.config.heartbeat_ttl_s

    def expire(self) -> list[str]:
        dead = [wid for wid, view in self.workers.items() if not self.alive(view)]
        for worker_id in dead:
            self.on_worker_gone(worker_id)
        self.index.expire(self.clock())
        return dead

    # ---- placement ---------------------------------------------------------------------------

    def candidates(self, request: m.PlacementRequest) -> list[WorkerView]:
        cutoff = self.clock() - self.config.heartbeat_ttl_s
        found = [view for view in self._eligible.get(request.model, {}).values() if view.last_seen >= cutoff]
        if not found:
            # Every worker's KV is past the ceiling: the request waits wherever it goes, so the
            # cost (cache, queues) decides rather than the shared queue's first free slot.
            found = [view for view in self._serving.get(request.model, {}).values() if view.last_seen >= cutoff]
        if request.adapter:
            adapter = request.adapter
            # Engines without LoRA support cannot serve it at all.
            found = [view for view in found if view.max_adapters > 0 or adapter in view.adapters]
        return found

    def place(self, request: m.PlacementRequest, record: bool = True) -> m.PlacementReply:
        """Choose a worker. With `record=False` the caller must call `record` with the reply (the
        router service answers first and updates its view after, off the request's path)."""
        candidates = self.candidates(request)
        if not candidates:
            return m.PlacementReply(target=subjects.ANY_TARGET, reason="no eligible worker")
        chosen, cached_blocks = self.choose(request, candidates)
        if record:
            self._count(chosen, request.prompt_tokens - cached_blocks * self.config.block_size, request.block_hashes,
                        cached_blocks)
        return m.PlacementReply(
            target=subjects.worker_target(chosen.worker_id), worker_id=chosen.worker_id,
            reason=self.name, cached_blocks=cached_blocks,
        )

    def record(self, request: m.PlacementRequest, reply: m.PlacementReply) -> None:
        """Count a placement made with `place(..., record=False)`."""
        view = self.workers.get(reply.worker_id or "")
        if view is not None:
            self._count(view, request.prompt_tokens - reply.cached_blocks * self.config.block_size, request.block_hashes,
                        reply.cached_blocks)

    @abc.abstractmethod
    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        """The worker to place on, and how many of the request's prefix blocks it holds."""

    def _count(self, view: WorkerView, prefill_tokens: int, hashes: list[int], known_blocks: int = 0) -> None:
        view.placed_total += 1
        view.placed_prefill.append(view.placed_prefill[-1] + max(0, prefill_tokens))
        self._refresh(view)
        if hashes:
            self.index.add(view.worker_id, hashes, self.clock(), known=known_blocks)

    def _softmax_pick(self, costs: list[float]) -> int:
        """An index drawn with weight exp(-(cost - best) / temperature); choices more than ten
        temperatures worse (weight < 5e-5) are left out, which keeps this cheap on big fleets."""
        best = min(costs)
        temperature = max(self.config.temperature, 1e-9)
        cutoff = best + 10 * temperature
        near = [i for i, cost in enumerate(costs) if cost <= cutoff]
        if len(near) == 1:
            return near[0]
        weights = [math.exp((best - costs[i]) / temperature) for i in near]
        return self.rng.choices(near, weights)[0]


class RoundRobinPolicy(Policy):
    name = "round_robin"
    _turn: int = 0

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        candidates = sorted(candidates, key=lambda view: view.worker_id)
        self._turn = (self._turn + 1) % len(candidates)
        return candidates[self._turn], 0


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        costs = [(view.reported_load + view.backlog()) / view.max_running for view in candidates]
        return candidates[self._softmax_pick(costs)], 0


class AffinityPolicy(Policy):
    name = "affinity"

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        config = self.config
        block_size = config.block_size
        hashes = request.block_hashes if request.block_size == block_size else []
        matched = self.index.matched_blocks(hashes) if hashes else {}
        per_token = config.miss_weight / config.prefill_tokens_per_s
        prompt = request.prompt_tokens
        if matched:
            get = matched.get
            costs = [view.base_cost + per_token * max(0, prompt - block_size * get(view.worker_id, 0))
                     for view in candidates]
        else:
            miss = per_token * prompt
            costs = [view.base_cost + miss for view in candidates]
        if request.adapter:
            adapter, penalty = request.adapter, config.adapter_load_s
            costs = [cost if adapter in view.adapters else cost + penalty for cost, view in zip(costs, candidates)]
        chosen = candidates[self._softmax_pick(costs)]
        return chosen, matched.get(chosen.worker_id, 0)


_POLICIES: dict[str, type[Policy]] = {
    "affinity": AffinityPolicy, "least_loaded": LeastLoadedPolicy, "round_robin": RoundRobinPolicy,
}


def make_policy(
    name: str, clock: Callable[[], float], config: RoutingConfig | None = None, rng: random.Random | None = None
) -> Policy:
    try:
        kind = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return kind(clock=clock, config=config or RoutingConfig(), rng=rng or random.Random())
