"""Placement: the registry's filters, the policy's choice among the survivors, the registry's
bookkeeping of it. Pure, with an injected clock and random source, so the router service, unit
tests and the fleet simulators run the same code."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from proto import messages as m
from proto import subjects

from .config import RoutingConfig
from .policies import Policy, make_policy
from .registry import WorkerRegistry, WorkerView
from .zones import prefer_zone

# The subject of a worker's own queue, escaped once per worker rather than once per placement.
worker_target = functools.lru_cache(maxsize=65_536)(subjects.worker_target)


class Placer:
    def __init__(self, registry: WorkerRegistry, policy: Policy) -> None:
        self.registry = registry
        self.policy = policy

    @property
    def name(self) -> str:
        return self.policy.name

    def place(self, request: m.PlacementRequest, record: bool = True) -> m.PlacementReply:
        """Choose a worker. With `record=False` the caller must call `record` with the reply (the
        router service answers first and updates its view after, off the request's path)."""
        self.registry.adapter_slots.observe(request.adapter)
        candidates = prefer_zone(self.registry.candidates(request), request.zone)
        if not candidates:
            return m.PlacementReply(target=subjects.ANY_TARGET, reason="no eligible worker")
        chosen, cached_blocks = self.policy.choose(request, candidates)
        if record:
            self.count(request, chosen, cached_blocks)
            self.registry.adapter_slots.on_placed(chosen.worker_id, request.adapter, chosen.adapters)
        return self.reply(chosen, cached_blocks)

    def reply(self, chosen: WorkerView, cached_blocks: int) -> m.PlacementReply:
        return m.PlacementReply(
            target=worker_target(chosen.worker_id), worker_id=chosen.worker_id,
            reason=self.policy.name, cached_blocks=cached_blocks,
        )

    def count(self, request: m.PlacementRequest, chosen: WorkerView, cached_blocks: int) -> None:
        """The registry's bookkeeping of placing `request` on `chosen`."""
        self.registry.count(chosen, request.prompt_tokens - cached_blocks * self.registry.config.block_size,
                            request.block_hashes, cached_blocks, request.prompt_tokens)

    def record(self, request: m.PlacementRequest, reply: m.PlacementReply) -> None:
        """Count a placement made with `place(..., record=False)`."""
        view = self.registry.workers.get(reply.worker_id or "")
        if view is not None:
            self.count(request, view, reply.cached_blocks)
            self.registry.adapter_slots.on_placed(view.worker_id, request.adapter, view.adapters)


    def warm_target(self, request: m.PlacementRequest) -> str | None:
        """A worker to load the request's adapter on in the background (adapter_slots.py), if its
        homes take a newcomer that holds it nowhere yet; counted as a load asked for there."""
        if not request.adapter:
            return None
        candidates = prefer_zone(self.registry.candidates(request), request.zone)
        workers = [(view.worker_id, view.max_adapters, view.adapters) for view in candidates]
        return self.registry.adapter_slots.warm_target(request.adapter, workers) if workers else None


def make_placer(
    name: str, clock: Callable[[], float], config: RoutingConfig | None = None, rng: random.Random | None = None
) -> Placer:
    """A registry and the policy `name` (affinity, least_loaded or round_robin) placing from it."""
    registry = WorkerRegistry(clock, config)
    return Placer(registry, make_policy(name, registry, rng))
