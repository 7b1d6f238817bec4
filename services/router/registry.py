"""The router's view of the workers: pure, with an injected clock, fed the bus's events.

Every policy places from the same registry: heartbeats (which workers exist, their model, slots,
page size and adapters), load reports, cache events (the prefix index), and the placements every
router replica makes, counted per worker until the worker reports it has pulled them (the
backlog). It applies the hard filters every policy shares (alive, serving the model, not
draining, KV cache below a ceiling, able to serve the request's LoRA adapter) and keeps each
worker's base cost (the wait it adds to any request) current, so that a placement only adds the
request's own part.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from inferbus.releases import split
from proto import messages as m

from .adapter_slots import AdapterConfig, AdapterSlots
from .config import RoutingConfig
from .index import PrefixIndex


@dataclass
class WorkerView:
    worker_id: str
    model: str
    last_seen: float
    max_running: int = 1
    draining: bool = False
    block_size: int = 0
    max_adapters: int = 0
    max_loaded_adapters: int = 0  # its engine's cap on adapters in host memory (0: none)
    adapters: frozenset[str] = frozenset()
    adapter_prefetches: int = 0  # adapter prefetches queued or loading there at the last report
    release: str = ""  # the release the worker verified it serves ("" unpinned)
    zone: str = ""
    role: str = "aggregated"  # prefill/decode disaggregation (`m.Role`); pairs are chosen in `pairing.py`
    local_prefill: bool = False  # a decode worker whose engine can also compute a prompt
    kv_capacity_tokens: int = 0  # its engine's KV cache (0: unknown)
    tp: int = 0  # its engine's tensor-parallel width (0: unknown)
    reported_load: int = 0  # running + waiting in the engine at the last report
    reported_prefill: int = 0  # prompt tokens taken by the worker, not yet prefilled, at the last report
    running: int = 0
    kv_usage: float = 0.0
    kv_used_tokens: int = 0  # held by the engine's requests at the last report (not evictable cache)
    # Placements (by any router replica) against what the worker reports it pulled from its own
    # queue: the difference still waits in that queue, where no engine number shows it.
    placed_total: int = 0
    pulled_own: int = 0
    pulled_offset: int | None = None  # pulled_own when this router first heard from the worker
    # Running total of prefill tokens placed here, one entry per recent placement, so the prefill
    # of the last n placements is a subtraction.
    placed_prefill: deque[int] = field(default_factory=lambda: deque([0], maxlen=4097))
    # Prompt tokens (cached ones included) placed here, decaying over `RoutingConfig.share_window_s`,
    # and the fleet's mean of it at the registry's last tick: this worker's recent share of the
    # fleet's traffic (`set_base_cost`).
    intake: float = 0.0
    intake_mean: float = 0.0
    intake_requests: float = 0.0  # placements, decaying likewise
    share_limit: float = (
        0.0  # `RoutingConfig.share_limit`, widened when the fleet's window holds few requests per worker
    )
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


def set_base_cost(view: WorkerView, config: RoutingConfig, backlog: int | None = None) -> None:
    """The wait this worker adds to any request, in seconds: its queued prefill, its load, and its
    share of the fleet's recent traffic above (or below) the mean, capped at ±1 share.
    `backlog`: `view.backlog()`, when the caller has it."""
    if backlog is None:
        backlog = view.backlog()
    queued = view.reported_prefill + view.backlog_prefill(backlog) if backlog else view.reported_prefill
    cost = ((queued + config.active_kv_weight * view.kv_used_tokens) / config.prefill_tokens_per_s
            + config.decode_weight_s * (view.reported_load + backlog) / view.max_running)
    if view.intake_mean > 0.0:
        cost += share_cost(view.intake / view.intake_mean - 1.0, config, view.share_limit)
    view.base_cost = cost


def share_cost(excess: float, config: RoutingConfig, limit: float = 0.0) -> float:
    """The cost, in seconds, of a worker whose recent traffic is `excess` (0.1: 10%) above the
    fleet's mean: `share_weight_s` at half of `share_limit`, growing without bound towards the
    limit (a barrier: near it even a long cached prefix moves; past it, still growing with the
    excess, so that workers over the limit rank among themselves), a bonus of at most
    `share_weight_s` below the mean. `limit`: the worker's own (0: `config.share_limit`)."""
    limit = limit or config.share_limit
    if excess <= 0.0:
        return config.share_weight_s * max(excess, -limit) / limit
    room = limit - excess
    return config.share_weight_s * excess / (room if room > 0.01 * limit else 0.01 * limit)


class RegistryListener(Protocol):
    """Told of every change to a worker's view (the fleet simulator's sampler keeps its own
    per-worker weights this way)."""

    def worker_updated(self, view: WorkerView, eligible: bool, backlog: int) -> None: ...
    def worker_removed(self, view: WorkerView) -> None: ...


class WorkerRegistry:
    def __init__(self, clock: Callable[[], float], config: RoutingConfig | None = None) -> None:
        self.clock = clock
        self.config = config = config or RoutingConfig()
        self.workers: dict[str, WorkerView] = {}
        self.index = PrefixIndex(max_blocks_per_worker=config.index_blocks_per_worker, ttl_s=config.index_ttl_s)
        # Adapters' batch slots and homes (adapter_slots.py): fed here, priced by affinity.
        self.adapter_slots = AdapterSlots(clock, AdapterConfig(
            load_s=config.adapter_load_s, slot_hold_s=config.adapter_slot_hold_s, spread=config.adapter_spread,
            time_scale=config.time_scale))
        self.listeners: list[RegistryListener] = []
        # model → workers passing the filters that only events change: not draining (`_serving`),
        # and also below the KV ceiling (`_eligible`); liveness, which time changes, is checked
        # per placement.
        self._serving: dict[str, dict[str, WorkerView]] = {}
        self._eligible: dict[str, dict[str, WorkerView]] = {}
        self._split: dict[str, set[str]] = {}  # model → its prefill and decode workers (`disaggregated`)
        self._aged_at = clock()

    def _refresh(self, view: WorkerView) -> None:
        """Re-apply the event-driven filters and recompute the worker's base cost."""
        eligible = not (view.draining or view.kv_usage >= self.config.kv_ceiling)
        for pool, excluded in (
            (self._serving.setdefault(view.model, {}), view.draining),
            (self._eligible.setdefault(view.model, {}), not eligible),
        ):
            if excluded:
                pool.pop(view.worker_id, None)
            else:
                pool[view.worker_id] = view
        backlog = view.backlog()
        set_base_cost(view, self.config, backlog)
        for listener in self.listeners:
            listener.worker_updated(view, eligible, backlog)

    # ---- events ------------------------------------------------------------------------------

    def on_heartbeat(self, beat: m.Heartbeat) -> None:
        view = self.workers.get(beat.worker_id)
        if view is None:
            view = self.workers[beat.worker_id] = WorkerView(beat.worker_id, beat.model, self.clock())
        view.last_seen = self.clock()
        view.max_running = max(1, beat.max_running)
        view.draining = beat.state != "ready"  # draining, or its engine is down ("starting"): place nothing there
        view.block_size = beat.block_size
        view.max_adapters = beat.max_adapters
        view.max_loaded_adapters = beat.max_loaded_adapters
        self.adapter_slots.on_cap(beat.worker_id, beat.max_loaded_adapters)
        view.adapters = frozenset(beat.adapters)
        view.release = beat.release
        view.zone = beat.zone
        view.role = beat.role
        split = self._split.setdefault(view.model, set())
        if beat.role != "aggregated":
            split.add(view.worker_id)
        else:
            split.discard(view.worker_id)
        view.local_prefill = beat.local_prefill
        view.tp = beat.tp
        view.kv_capacity_tokens = beat.kv_capacity_tokens or view.kv_capacity_tokens
        self._refresh(view)

    def touch(self, worker_id: str) -> bool:
        """`on_heartbeat` for a beat identical to the worker's previous one (for the fleet
        simulator): its other fields are applied already, so only `last_seen` changes. False: the
        worker is not registered; send the beat itself."""
        view = self.workers.get(worker_id)
        if view is None:
            return False
        view.last_seen = self.clock()
        return True

    def on_worker_gone(self, worker_id: str) -> None:
        view = self.workers.pop(worker_id, None)
        if view is not None:
            self._split.get(view.model, set()).discard(worker_id)
            self._serving.get(view.model, {}).pop(worker_id, None)
            self._eligible.get(view.model, {}).pop(worker_id, None)
            for listener in self.listeners:
                listener.worker_removed(view)
        self.index.forget(worker_id)
        self.adapter_slots.on_worker_gone(worker_id)

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
        view.adapter_prefetches = load.adapter_prefetches
        view.kv_usage = load.kv_used_tokens / load.kv_capacity_tokens if load.kv_capacity_tokens else 0.0
        view.kv_used_tokens = load.kv_used_tokens
        view.kv_capacity_tokens = load.kv_capacity_tokens or view.kv_capacity_tokens
        self.adapter_slots.on_load(load.worker_id, load.adapter_requests, load.adapter_loads, load.adapter_load_s,
                                   view.adapters)
        self._refresh(view)

    def on_cache(self, event: m.CacheEvent) -> bool:
        """Apply a worker's cache event. False: events were missed, ask the worker to resync."""
        view = self.workers.get(event.worker_id)
        if view is None:
            return True  # not registered yet (its heartbeat follows); the resync on register covers it
        if not self.cache_compatible(view):
            return True  # hashes over other blocks than the gateways' never match: keep them out
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

    def cache_compatible(self, view: WorkerView) -> bool:
        """Whether the worker relays its engine's cache in the blocks the gateways hash prompts in
        (its INFERBUS_BLOCK_SIZE; a worker that does not say is taken at its word)."""
        return not view.block_size or view.block_size == self.config.block_size

    def on_placed(self, placed: m.Placed) -> None:
        """A placement made by another router replica."""
        view = self.workers.get(placed.worker_id)
        if view is not None:
            self.count(view, placed.prefill_tokens, placed.block_hashes, prompt_tokens=placed.prompt_tokens or None)
            self.adapter_slots.on_placed(placed.worker_id, placed.adapter, view.adapters)

    def alive(self, view: WorkerView) -> bool:
        return self.clock() - view.last_seen <= self.config.heartbeat_ttl_s

    def expire(self) -> list[str]:
        """The registry's tick (the router calls it every ~0.5 s): forget dead workers and stale
        index entries, and age the workers' traffic shares."""
        dead = [wid for wid, view in self.workers.items() if not self.alive(view)]
        for worker_id in dead:
            self.on_worker_gone(worker_id)
        now = self.clock()
        self.index.expire(now)
        self._age_intake(now)
        return dead

    def _age_intake(self, now: float) -> None:
        """Decay every worker's intake to `now` and give each the mean of its model's serving
        workers, then recompute their costs. Between ticks a worker's intake only grows by its own
        placements and the mean stays put, so its cost changes only on its own events (what the
        simulators' `LoadSampler` relies on)."""
        config = self.config
        if not config.share_weight_s:
            return
        elapsed = now - self._aged_at
        self._aged_at = now
        factor = math.exp(-elapsed / config.share_window_s) if elapsed > 0 else 1.0
        # Per model and role: a prefill pool's share is of the prefill traffic.
        pools = [[v for v in pool.values() if v.role == role] for pool in self._serving.values()
                 for role in {v.role for v in pool.values()}]
        for views in pools:
            if not views:
                continue
            for view in views:
                view.intake *= factor
                view.intake_requests *= factor
            mean = sum(view.intake for view in views) / len(views)
            # A share over few requests is mostly the luck of their sizes: the limit is never
            # narrower than `share_granularity` requests' worth of the mean (a big fleet's window
            # holds few requests per worker, and there the limit binds only on gross excess).
            requests = sum(view.intake_requests for view in views) / len(views)
            limit = max(config.share_limit, config.share_granularity / requests if requests > 0 else 1.0)
            for view in views:
                view.intake_mean = mean
                view.share_limit = limit
                self._refresh(view)

    # ---- placement ---------------------------------------------------------------------------

    def candidates(self, request: m.PlacementRequest) -> list[WorkerView]:
        """The workers that pass the hard filters for this request."""
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
        if request.release:  # a canary's split or a client's pin (inferbus.releases)
            found = split.workers_of(found, request.release, pinned=request.pinned)
        return found

    def disaggregated(self, model: str) -> bool:
        """Whether `model` has prefill or decode workers (placements are pairs: `pairing.py`)."""
        return bool(self._split.get(model))

    def eligible(self, model: str) -> dict[str, WorkerView]:
        """Workers of `model` not draining and below the KV ceiling (liveness not checked)."""
        return self._eligible.get(model, {})

    def count(self, view: WorkerView, prefill_tokens: int, hashes: list[int], known_blocks: int = 0,
              prompt_tokens: int | None = None) -> None:
        """Count a placement on `view` (this router's or another replica's): its backlog, the
        prefill it queues (`prompt_tokens` less what is cached there), the prefix blocks it will
        cache there."""
        backlog = self.add_placement(view, prefill_tokens, prompt_tokens)
        if self.listeners:
            eligible = self._eligible.get(view.model, {}).get(view.worker_id) is view
            for listener in self.listeners:
                listener.worker_updated(view, eligible, backlog)
        if hashes:
            self.index.add(view.worker_id, hashes, self.clock(), known=known_blocks)

    def add_placement(self, view: WorkerView, prefill_tokens: int, prompt_tokens: int | None = None) -> int:
        """`count`'s load bookkeeping alone, without telling the listeners: the caller, which
        knows the worker is eligible, updates what it keeps itself. Returns the worker's backlog.
        A placement changes neither the worker's model, draining nor KV use: only its load.
        `prompt_tokens` None: the whole prompt is prefill."""
        view.placed_total += 1
        view.intake += prefill_tokens if prompt_tokens is None else prompt_tokens
        view.intake_requests += 1.0
        totals = view.placed_prefill
        totals.append(totals[-1] + (prefill_tokens if prefill_tokens > 0 else 0))
        backlog = view.placed_total - view.pulled_own + (view.pulled_offset or 0)  # `view.backlog()`, inlined
        if backlog < 0:
            backlog = 0
        set_base_cost(view, self.config, backlog)
        return backlog
