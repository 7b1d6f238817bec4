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
             + the adapter's part (adapter_slots.py): loading it, waiting for a free
               distinct-adapter batch slot, and spreading a hot adapter over several workers,

  `miss_weight` (5) > 1 because recomputing a prefix costs the whole fleet GPU time, not only this
  request its wait: the work it adds delays everything queued behind it.

  with a softmax at a small temperature over the cost so that several router replicas, or bursts
  within one report interval, do not all land on one worker. A hot prefix spills to the next-best
  worker by itself: each placement adds its prefill to the chosen worker's queue until another
  worker, even without the prefix, becomes cheaper, and that worker then caches it too.
"""

from __future__ import annotations

import abc
import bisect
import functools
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from inferbus.tokens import DEFAULT_BLOCK_SIZE
from proto import messages as m
from proto import subjects

from .adapter_slots import AdapterConfig, AdapterSlots
from .index import PrefixIndex

# The subject of a worker's own queue, escaped once per worker rather than once per placement.
_worker_target = functools.lru_cache(maxsize=65_536)(subjects.worker_target)

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
    adapter_slot_hold_s: float = 2.0  # mean time a running request holds its adapter's batch slot
    adapter_spread: float = 2.0  # workers a hot adapter may use per worker-equivalent of its traffic
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


def _set_base_cost(view: WorkerView, config: RoutingConfig, backlog: int | None = None) -> None:
    """The wait this worker adds to any request, in seconds: its queued prefill and its load.
    `backlog`: `view.backlog()`, when the caller has it."""
    if backlog is None:
        backlog = view.backlog()
    queued = view.reported_prefill + view.backlog_prefill(backlog) if backlog else view.reported_prefill
    view.base_cost = (queued / config.prefill_tokens_per_s
                      + config.decode_weight_s * (view.reported_load + backlog) / view.max_running)


@dataclass
class Policy(abc.ABC):
    """The registry and filters every policy shares; subclasses choose among the candidates."""

    clock: Callable[[], float]
    config: RoutingConfig = field(default_factory=RoutingConfig)
    rng: random.Random = field(default_factory=random.Random)
    workers: dict[str, WorkerView] = field(default_factory=dict)
    index: PrefixIndex = field(init=False)

    name = "base"
    _ranks_by_base_cost = True  # `choose` reads `WorkerView.base_cost` (the fast path keeps it current)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(
            max_blocks_per_worker=self.config.index_blocks_per_worker, ttl_s=self.config.index_ttl_s
        )
        # model → workers passing the filters that only events change: not draining (`_serving`),
        # and also below the KV ceiling (`_eligible`); liveness, which time changes, is checked
        # per placement.
        self._serving: dict[str, dict[str, WorkerView]] = {}
        self._eligible: dict[str, dict[str, WorkerView]] = {}
        self._fast: dict[str, _FastPool] | None = None  # model → pool; None: fast path off
        self.adapter_slots = AdapterSlots(self.clock, AdapterConfig(
            load_s=self.config.adapter_load_s, slot_hold_s=self.config.adapter_slot_hold_s,
            spread=self.config.adapter_spread))

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
        _set_base_cost(view, self.config)
        if self._fast is not None:
            self._fast_update(view)

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
        view.adapters = frozenset(beat.adapters)
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
            self._serving.get(view.model, {}).pop(worker_id, None)
            self._eligible.get(view.model, {}).pop(worker_id, None)
            if self._fast is not None and view.model in self._fast:
                self._fast[view.model].remove(worker_id)
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
        view.kv_usage = load.kv_used_tokens / load.kv_capacity_tokens if load.kv_capacity_tokens else 0.0
        self.adapter_slots.on_load(load.worker_id, load.adapter_requests)
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
            self._count(view, placed.prefill_tokens, placed.block_hashes)
            self.adapter_slots.on_placed(placed.worker_id, placed.adapter)

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
        self.adapter_slots.observe(request.adapter)
        fast = self._fast_choose(request) if self._fast is not None and not request.adapter else None
        if fast is not None:
            chosen, cached_blocks = fast, 0
        else:
            candidates = self.candidates(request)
            if not candidates:
                return m.PlacementReply(target=subjects.ANY_TARGET, reason="no eligible worker")
            chosen, cached_blocks = self.choose(request, candidates)
        if record:
            self._count(chosen, request.prompt_tokens - cached_blocks * self.config.block_size, request.block_hashes,
                        cached_blocks)
            self.adapter_slots.on_placed(chosen.worker_id, request.adapter)
        return m.PlacementReply(
            target=_worker_target(chosen.worker_id), worker_id=chosen.worker_id,
            reason=self.name, cached_blocks=cached_blocks,
        )

    def record(self, request: m.PlacementRequest, reply: m.PlacementReply) -> None:
        """Count a placement made with `place(..., record=False)`."""
        view = self.workers.get(reply.worker_id or "")
        if view is not None:
            self._count(view, request.prompt_tokens - reply.cached_blocks * self.config.block_size, request.block_hashes,
                        reply.cached_blocks)
            self.adapter_slots.on_placed(view.worker_id, request.adapter)

    @abc.abstractmethod
    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        """The worker to place on, and how many of the request's prefix blocks it holds."""

    def _count(self, view: WorkerView, prefill_tokens: int, hashes: list[int], known_blocks: int = 0) -> None:
        view.placed_total += 1
        view.placed_prefill.append(view.placed_prefill[-1] + max(0, prefill_tokens))
        self._refresh(view)
        if hashes:
            self.index.add(view.worker_id, hashes, self.clock(), known=known_blocks)

    # ---- fast path (opt-in, for the fleet simulator) ---------------------------------------------

    def enable_fast_path(self) -> None:
        """Place load-only requests in O(√n) C-level steps with the same distribution as `choose`.

        Off by default: the router service never turns it on, so production placement is unchanged.
        The fleet simulator (`inferbus.fleetsim.fast`) does, because `choose` is O(workers) per
        request. It applies when a request's cost is a worker's load cost plus a constant the same
        for every worker (no adapter; for affinity, no prefix block cached anywhere), i.e. when the
        softmax only sees the load cost. Each model keeps blocked sums of softmax weights
        exp(-(key - ref) / temperature) over eligible workers and a lazy min-heap of keys, both
        updated in `_refresh`; a draw is exact by rejection: a worker more than ten temperatures
        above the best, or no longer alive, is drawn again (the slow path excludes both). When the
        best worker is not alive or the pool is empty it falls back to the slow path.
        """
        if self._fast is None:
            self._fast = {}
            for view in self.workers.values():
                self._fast_update(view)

    def _fast_key(self, view: WorkerView) -> float | None:
        """The load-only cost `choose` ranks this worker by; None: this policy has no fast path."""
        return None

    def _fast_applies(self, request: m.PlacementRequest) -> bool:
        return True

    def _fast_update(self, view: WorkerView) -> None:
        assert self._fast is not None
        key = self._fast_key(view)
        if key is None:
            return
        pool = self._fast.get(view.model)
        if pool is None:
            pool = self._fast[view.model] = _FastPool(max(self.config.temperature, 1e-9))
        eligible = self._eligible.get(view.model, {}).get(view.worker_id) is view
        pool.update(view, key if eligible else None)

    def _fast_choose(self, request: m.PlacementRequest) -> WorkerView | None:
        assert self._fast is not None
        if not self._fast_applies(request):
            return None
        return self._fast_choose_model(request.model)

    def _fast_choose_model(self, model: str) -> WorkerView | None:
        assert self._fast is not None
        pool = self._fast.get(model)
        if pool is None:
            return None
        cutoff = self.clock() - self.config.heartbeat_ttl_s
        best = pool.best()
        if best is None or best[1].last_seen < cutoff:
            return None
        limit = best[0] + 10 * pool.temperature
        random_ = self.rng.random
        for _ in range(32):
            view, key = pool.sample(random_())
            if key <= limit and view.last_seen >= cutoff:
                return view
        return None

    def place_load_only(self, model: str, prompt_tokens: int) -> str | None:
        """The fast path's `place(PlacementRequest(model=model, prompt_tokens=prompt_tokens))` for a
        request with no adapter and no prefix hashes, recorded: the chosen worker's id.

        The same choice and the same bookkeeping as `place`, without the message objects: a worker
        drawn from the weights is eligible (it has a weight), and a placement changes neither
        its eligibility nor anything but its load cost, so only that is recomputed. When the fast
        path has no answer it is `place` itself (None: no eligible worker).
        """
        fast = self._fast
        view = None
        pool = fast.get(model) if fast is not None else None
        if pool is not None:
            # `_fast_choose_model`, inlined (once per simulated request).
            cutoff = self.clock() - self.config.heartbeat_ttl_s
            best = pool.best()
            if best is not None and best[1].last_seen >= cutoff:
                limit = best[0] + 10 * pool.temperature
                random_, sample = self.rng.random, pool.sample
                for _ in range(32):
                    drawn, key = sample(random_())
                    if key <= limit and drawn.last_seen >= cutoff:
                        view = drawn
                        break
        if view is None:
            return self.place(m.PlacementRequest(request_id="", model=model, prompt_tokens=prompt_tokens)).worker_id
        view.placed_total += 1
        totals = view.placed_prefill
        totals.append(totals[-1] + (prompt_tokens if prompt_tokens > 0 else 0))
        backlog = view.placed_total - view.pulled_own + (view.pulled_offset or 0)  # `view.backlog()`, inlined
        if backlog < 0:
            backlog = 0
        if self._ranks_by_base_cost:
            _set_base_cost(view, self.config, backlog)
        # else `base_cost` is not read by this policy; `_refresh` sets it again on the next report.
        pool.update(view, self._placed_key(view, backlog))  # type: ignore[union-attr]
        return view.worker_id

    def _placed_key(self, view: WorkerView, backlog: int) -> float | None:
        """`_fast_key(view)`, given `view.backlog()`."""
        return self._fast_key(view)

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
    _ranks_by_base_cost = False

    def _fast_key(self, view: WorkerView) -> float | None:
        return (view.reported_load + view.backlog()) / view.max_running

    def _placed_key(self, view: WorkerView, backlog: int) -> float | None:
        return (view.reported_load + backlog) / view.max_running

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        costs = [(view.reported_load + view.backlog()) / view.max_running for view in candidates]
        return candidates[self._softmax_pick(costs)], 0


class AffinityPolicy(Policy):
    name = "affinity"

    def _fast_key(self, view: WorkerView) -> float | None:
        return view.base_cost  # every cost is base_cost + the request's miss cost, the same everywhere

    def _placed_key(self, view: WorkerView, backlog: int) -> float | None:
        return view.base_cost

    def _fast_applies(self, request: m.PlacementRequest) -> bool:
        hashes = request.block_hashes if request.block_size == self.config.block_size else []
        return not hashes or not self.index.matched_blocks(hashes)

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
        if request.adapter or (candidates[0].max_adapters and self.adapter_slots.lora_seen):
            extra = self.adapter_slots.costs(
                request.adapter, [(view.worker_id, view.max_adapters, view.adapters) for view in candidates])
            costs = [cost + more for cost, more in zip(costs, extra)]
        chosen = candidates[self._softmax_pick(costs)]
        return chosen, matched.get(chosen.worker_id, 0)


class _FastPool:
    """Softmax weights of one model's eligible workers, and a lazy min-heap of keys.

    Weights are exp((ref - key) / temperature) against a reference key that is moved (and the
    weights recomputed) when keys drift far from it, so that weights neither overflow nor
    underflow where it matters. They are kept in blocks of `block` slots with each block's sum
    beside them: an update recomputes one block's sum (recomputed, not incremented: no
    floating-point drift) and a draw bisects the cumulative block sums, then the cumulative
    weights in one block. Both are a few C-level calls (`sum`, `accumulate`, `bisect`) rather
    than a Python loop down a binary tree, which is what makes them cheap in CPython.
    """

    __slots__ = ("temperature", "size", "block", "weights", "sums", "slots", "views", "keys", "versions", "free",
                 "heap", "ref", "_seq")

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.size = 64
        self.block = 8  # about sqrt(size), a power of two
        self.weights = [0.0] * self.size
        self.sums = [0.0] * (self.size // self.block)
        self.slots: dict[str, int] = {}
        self.views: list[WorkerView | None] = [None] * self.size
        self.keys: list[float] = [0.0] * self.size
        self.versions: dict[str, int] = {}
        self.free = list(range(self.size - 1, -1, -1))
        self.heap: list[tuple[float, int, str]] = []
        self.ref: float | None = None
        self._seq = 0

    def update(self, view: WorkerView, key: float | None) -> None:
        """`key` None: the worker is not eligible (weight 0, out of the heap)."""
        wid = view.worker_id
        slot = self.slots.get(wid)
        if slot is not None and key is not None and key == self.keys[slot] and wid in self.versions:
            return  # unchanged (a heartbeat, say)
        if slot is None:
            if key is None:
                return
            if not self.free:
                self._grow()
            slot = self.slots[wid] = self.free.pop()
            self.views[slot] = view
        self._seq += 1
        if key is None:
            self.versions.pop(wid, None)
            self._set(slot, 0.0)
            return
        self.versions[wid] = self._seq
        self.keys[slot] = key
        heapq.heappush(self.heap, (key, self._seq, wid))
        if not self._seq & 63 and len(self.heap) > 4 * len(self.slots) + 64:  # checked now and then: cheaper
            self.heap = [(self.keys[self.slots[w]], v, w) for w, v in self.versions.items()]
            heapq.heapify(self.heap)
        ref = self.ref
        if ref is None or ref - key > 600 * self.temperature:
            self._rebuild(key)  # far below the reference: its weight would overflow
            return
        exponent = (ref - key) / self.temperature
        # `_set`, inlined (once per placement).
        weights = self.weights
        weights[slot] = math.exp(exponent) if exponent > -700 else 0.0
        block = self.block
        first = slot - slot % block
        self.sums[first // block] = sum(weights[first:first + block])

    def remove(self, wid: str) -> None:
        slot = self.slots.pop(wid, None)
        if slot is None:
            return
        self.versions.pop(wid, None)
        self.views[slot] = None
        self._set(slot, 0.0)
        self.free.append(slot)

    def best(self) -> tuple[float, WorkerView] | None:
        heap, versions = self.heap, self.versions
        while heap:
            key, version, wid = heap[0]
            if versions.get(wid) == version:
                view = self.views[self.slots[wid]]
                assert view is not None
                if self.ref is not None and abs(self.ref - key) > 300 * self.temperature:
                    self._rebuild(key)
                return key, view
            heapq.heappop(heap)
        return None

    def sample(self, u: float) -> tuple[WorkerView, float]:
        cumulative = list(itertools.accumulate(self.sums))
        target = u * cumulative[-1]
        b = bisect.bisect_right(cumulative, target)
        if b < len(cumulative):
            if b:
                target -= cumulative[b - 1]
            block = self.block
            first = b * block
            within = list(itertools.accumulate(self.weights[first:first + block]))
            i = bisect.bisect_right(within, target)
            if i < block:
                slot = first + i
                view = self.views[slot]
                if view is not None and self.weights[slot] > 0.0:
                    return view, self.keys[slot]
        best = self.best()  # rounding at a boundary: take the best instead
        assert best is not None
        return best[1], best[0]

    def _set(self, slot: int, weight: float) -> None:
        weights = self.weights
        weights[slot] = weight
        block = self.block
        first = slot - slot % block
        self.sums[first // block] = sum(weights[first:first + block])

    def _grow(self) -> None:
        old = self.size
        self.size *= 2
        self.block = 1 << ((self.size.bit_length() - 1 + 1) // 2)
        self.views.extend([None] * old)
        self.keys.extend([0.0] * old)
        self.free.extend(range(self.size - 1, old - 1, -1))
        self._rebuild(self.ref if self.ref is not None else 0.0)

    def _rebuild(self, ref: float) -> None:
        self.ref = ref
        size, block = self.size, self.block
        weights = self.weights = [0.0] * size
        for wid, slot in self.slots.items():
            if wid in self.versions:
                exponent = (ref - self.keys[slot]) / self.temperature
                weights[slot] = math.exp(exponent) if exponent > -700 else 0.0
        self.sums = [sum(weights[i:i + block]) for i in range(0, size, block)]


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
