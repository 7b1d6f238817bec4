"""The router's placement for load-only requests, drawn in O(√n) C-level steps: for the fleet
simulators, never the router service.

`Placer.place` costs O(workers) per request, more than the fast simulator's whole budget per
request on a fleet of hundreds. When a request's cost on every worker is that worker's
`Policy.load_cost` plus a constant the same for every worker (`Policy.load_only`: no adapter; for
affinity, no prefix block cached anywhere), the softmax only sees the load costs. A `LoadSampler`
listens to the registry and keeps, per model, blocked sums of softmax weights
exp(-(cost - ref) / temperature) over eligible workers and a lazy min-heap of costs; a draw is
exact by rejection: a worker more than ten temperatures above the best, or no longer alive, is
drawn again (`place` leaves both out). When the best worker is not alive, or the pool is empty, it
asks the placer itself. Placements are counted by the registry (`WorkerRegistry.count`, or its
`add_placement` for the load-only fast path).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

from proto import messages as m
from services.router.placement import Placer
from services.router.registry import WorkerView


class LoadSampler:
    def __init__(self, placer: Placer) -> None:
        self.placer = placer
        self.registry = registry = placer.registry
        self.policy = placer.policy
        self.pools: dict[str, SoftmaxPool] = {}  # model → its eligible workers' weights
        self._temperature = max(registry.config.temperature, 1e-9)
        registry.listeners.append(self)
        for view in registry.workers.values():
            self.worker_updated(view, registry.eligible(view.model).get(view.worker_id) is view, view.backlog())

    @property
    def name(self) -> str:
        return self.placer.name

    # ---- the registry's listener -------------------------------------------------------------

    def worker_updated(self, view: WorkerView, eligible: bool, backlog: int) -> None:
        cost = self.policy.load_cost(view, backlog)
        if cost is None:
            return
        pool = self.pools.get(view.model)
        if pool is None:
            pool = self.pools[view.model] = SoftmaxPool(self._temperature)
        pool.update(view, cost if eligible else None)

    def worker_removed(self, view: WorkerView) -> None:
        pool = self.pools.get(view.model)
        if pool is not None:
            pool.remove(view.worker_id)

    # ---- placing -----------------------------------------------------------------------------

    def draw(self, model: str) -> WorkerView | None:
        """A worker drawn as `Policy.choose` would for a load-only request; None: ask the placer."""
        pool = self.pools.get(model)
        if pool is None:
            return None
        cutoff = self.registry.clock() - self.registry.config.heartbeat_ttl_s
        best = pool.best()
        if best is None or best[1].last_seen < cutoff:
            return None
        limit = best[0] + 10 * pool.temperature
        random_, sample = self.policy.rng.random, pool.sample
        for _ in range(32):
            drawn, cost = sample(random_())
            if cost <= limit and drawn.last_seen >= cutoff:
                return drawn
        return None

    def place(self, request: m.PlacementRequest, record: bool = True) -> m.PlacementReply:
        """`Placer.place`, drawn here when the request is load-only."""
        if self.policy.load_only(request):
            view = self.draw(request.model)
            if view is not None:
                if record:
                    self.placer.count(request, view, 0)
                return self.placer.reply(view, 0)
        return self.placer.place(request, record)

    def place_load_only(self, model: str, prompt_tokens: int) -> str | None:
        """`place(PlacementRequest(model=model, prompt_tokens=prompt_tokens))` for a request with
        no adapter and no prefix hashes, recorded, without the message objects: the chosen
        worker's id (None: no eligible worker). Counted by the registry; the drawn worker is
        eligible (it has a weight), so only its cost here changes."""
        view = self.draw(model)
        if view is None:
            return self.placer.place(
                m.PlacementRequest(request_id="", model=model, prompt_tokens=prompt_tokens)
            ).worker_id
        backlog = self.registry.add_placement(view, prompt_tokens)
        self.pools[model].update(view, self.policy.load_cost(view, backlog))
        return view.worker_id


class SoftmaxPool:
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
