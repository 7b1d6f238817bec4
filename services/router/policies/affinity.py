"""`affinity` (the default): the lowest estimated time to first token,

    cost = (queued prefill tokens + miss_weight · prompt tokens not cached there
            + active_kv_weight · KV tokens its requests hold) / prefill rate
           + decode_weight · running / slots
           + the worker's share of the fleet's recent traffic above the mean (a barrier at
             share_limit, `registry.share_cost`): hot families' cached tokens are cheap to
             serve one at a time but add up, and they keep coming back to the same worker
           + the adapter's part (adapter_slots.py): loading it, waiting for a free
             distinct-adapter batch slot, and spreading a hot adapter over several workers,

`miss_weight` (5) > 1 because recomputing a prefix costs the whole fleet GPU time, not only this
request its wait: the work it adds delays everything queued behind it.

with a softmax at a small temperature over the cost so that several router replicas, or bursts
within one report interval, do not all land on one worker. A hot prefix spills to the next-best
worker by itself: each placement adds its prefill to the chosen worker's queue until another
worker, even without the prefix, becomes cheaper, and that worker then caches it too.

The queued-prefill, load and share terms are the registry's `base_cost`, kept current on every event
(the share's fleet mean on the registry's tick, `expire`).
"""

from __future__ import annotations

from proto import messages as m

from ..registry import WorkerView
from .base import RegistryPolicy


class AffinityPolicy(RegistryPolicy):
    name = "affinity"

    def load_cost(self, view: WorkerView, backlog: int) -> float | None:
        return view.base_cost  # every cost is base_cost + the request's miss cost, the same everywhere

    def load_only(self, request: m.PlacementRequest) -> bool:
        if request.adapter:
            return False
        hashes = request.block_hashes if request.block_size == self.config.block_size else []
        return not hashes or not self.index.matched_blocks(hashes)

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        config = self.config
        block_size = config.block_size
        hashes = request.block_hashes if request.block_size == block_size else []
        matched = self.index.matched_blocks(hashes) if hashes else {}
        per_token = config.miss_weight / config.prefill_tokens_per_s
        prompt = request.prompt_tokens
        if matched and block_size * max(matched.values()) <= prompt:
            # No worker holds more than the prompt (always, for hashes of this prompt): the miss
            # is the whole prompt less a credit per cached block, with no floor to check.
            get = matched.get
            miss, credit = per_token * prompt, per_token * block_size
            costs = [view.base_cost + miss - credit * get(view.worker_id, 0) for view in candidates]
        elif matched:
            get = matched.get
            costs = [view.base_cost + per_token * max(0, prompt - block_size * get(view.worker_id, 0))
                     for view in candidates]
        else:
            miss = per_token * prompt
            costs = [view.base_cost + miss for view in candidates]
        slots = self.registry.adapter_slots
        if request.adapter or (candidates[0].max_adapters and slots.lora_seen):
            extra = slots.costs(
                request.adapter, [(view.worker_id, view.max_adapters, view.adapters) for view in candidates]
            )
            costs = [cost + more for cost, more in zip(costs, extra)]
        chosen = candidates[self._softmax_pick(costs)]
        return chosen, matched.get(chosen.worker_id, 0)
