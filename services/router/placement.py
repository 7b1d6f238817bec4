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
from .pairing import Pair, PairConfig, PairPolicy
from .policies import Policy, make_policy
from .registry import WorkerRegistry, WorkerView
from .zones import prefer_zone

# The subject of a worker's own queue, escaped once per worker rather than once per placement.
worker_target = functools.lru_cache(maxsize=65_536)(subjects.worker_target)


class Placer:
    def __init__(self, registry: WorkerRegistry, policy: Policy, pairing: PairPolicy | None = None) -> None:
        self.registry = registry
        self.policy = policy
        self.pairing = pairing or PairPolicy(registry, rng=policy.rng)

    @property
    def name(self) -> str:
        return self.policy.name

    def place(self, request: m.PlacementRequest, record: bool = True) -> m.PlacementReply:
        """Choose a worker. With `record=False` the caller must call `record` with the reply (the
        router service answers first and updates its view after, off the request's path)."""
        self.registry.adapter_slots.observe(request.adapter)
        found = self.registry.candidates(request)
        if request.role == "prefill" or self.registry.disaggregated(request.model):
            return self._place_disaggregated(request, found, record)
        candidates = prefer_zone(found, request.zone)
        if not candidates:
            return m.PlacementReply(target=subjects.ANY_TARGET, reason="no eligible worker")
        chosen, cached_blocks = self.policy.choose(request, candidates)
        if record:
            self.count(request, chosen, cached_blocks)
            self.registry.adapter_slots.on_placed(chosen.worker_id, request.adapter, chosen.adapters)
        return self.reply(chosen, cached_blocks)

    def _place_disaggregated(self, request: m.PlacementRequest, found: list[WorkerView],
                             record: bool) -> m.PlacementReply:
        """A pair (pairing.py), or, for a decode worker's question, a prefill worker."""
        if request.role == "prefill":
            chosen = self.pairing.choose_prefill(request, found)
            if chosen is None:
                return m.PlacementReply(target=subjects.ANY_TARGET, reason="no prefill worker")
            reply = m.PlacementReply(target=worker_target(chosen[0].worker_id), worker_id=chosen[0].worker_id,
                                     reason="prefill", cached_blocks=chosen[1])
        else:
            pair = self.pairing.choose(request, found)
            if pair is None:
                return m.PlacementReply(target=subjects.ANY_TARGET, reason="no eligible pair")
            reply = self.pair_reply(pair)
        if record:
            self.record(request, reply)
        return reply

    @staticmethod
    def pair_reply(pair: Pair) -> m.PlacementReply:
        return m.PlacementReply(
            target=worker_target(pair.decode.worker_id), worker_id=pair.decode.worker_id, reason=pair.reason,
            cached_blocks=pair.prefill_cached_blocks if pair.prefill is None else 0,
            prefill_worker_id=pair.prefill.worker_id if pair.prefill is not None else None,
            prefill_cached_blocks=pair.prefill_cached_blocks if pair.prefill is not None else 0,
        )

    def placements(self, request: m.PlacementRequest, reply: m.PlacementReply) -> list[tuple[str, int, list[int], int]]:
        """What a placement adds where: (worker, prompt tokens it must compute, prefix blocks it
        will hold, blocks it held) per worker. A pair's decode worker computes none of the prompt
        and indexes none of it (its engine receives the KV, it does not compute it)."""
        block = self.registry.config.block_size
        if reply.worker_id is None:
            return []
        if reply.prefill_worker_id:
            return [(reply.worker_id, 0, [], 0),
                    (reply.prefill_worker_id, max(0, request.prompt_tokens - reply.prefill_cached_blocks * block),
                     request.block_hashes, reply.prefill_cached_blocks)]
        return [(reply.worker_id, max(0, request.prompt_tokens - reply.cached_blocks * block), request.block_hashes,
                 reply.cached_blocks)]

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
        """Count a placement made with `place(..., record=False)`: on both workers of a pair."""
        for worker_id, prefill_tokens, hashes, known in self.placements(request, reply):
            view = self.registry.workers.get(worker_id)
            if view is not None:
                self.registry.count(view, prefill_tokens, hashes, known, request.prompt_tokens)
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
    name: str, clock: Callable[[], float], config: RoutingConfig | None = None, rng: random.Random | None = None,
    pair_config: PairConfig | None = None,
) -> Placer:
    """A registry and the policy `name` (affinity, least_loaded or round_robin) placing from it;
    on a disaggregated fleet, pairs (`pairing.py`, with `pair_config`)."""
    registry = WorkerRegistry(clock, config)
    policy = make_policy(name, registry, rng)
    return Placer(registry, policy, PairPolicy(registry, pair_config, policy.rng))
