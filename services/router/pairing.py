"""Placement on a disaggregated fleet: a prefill worker and a decode worker for each request.

Pure, on the registry every policy reads (`registry.py`), with the policy's random source. Why the
two halves are chosen on different signals:

- **Prefill** (the prompt's compute, and its prefix cache): by the affinity cost, the lowest
  estimated time to the prompt's KV (`prefill_cost`: the worker's queued prefill and load, a cache
  miss priced at `miss_weight` as on an aggregated fleet, the adapter's part). The cache that
  matters is the prefill engine's: a decode engine receives every prompt token's KV.
- **Decode** (the tokens): by its load (running, waiting and placed-but-not-pulled per slot) and
  its KV room (`decode_cost`). It must hold the whole prompt's KV for as long as the request
  runs; a worker without room for the prompt is left out while one with room exists.
- **The pair** stays in one zone (the KV crosses the link between them: NVLink or RDMA inside a
  zone, not a WAN), the asking gateway's while it has room (`zones.prefer_zone`); both halves
  serve the request's LoRA adapter (the registry's filters, applied to both).
- **Conditional disaggregation** (NVIDIA Dynamo's: a decode worker prefills a short prompt itself
  rather than queue it for a prefill worker and wait for its transfer). Priced per decode worker
  that can compute a prompt (`Heartbeat.local_prefill`): its own uncached tokens, and the stall
  of every stream it runs while it computes them (`local_cost`), against the prefill worker's
  cost plus the transfer of the prompt's KV (`transfer_s`). It is chosen where it is cheaper and
  the remainder is at most `local_prefill_max_tokens`. SGLang 0.5.23's decode mode cannot
  compute a prompt (every request needs a bootstrap room), so with its engines this option is
  priced and never taken.

An aggregated worker in the same fleet (a fleet being converted) is one more option, priced as
the affinity policy prices it: the platform keeps one placement answer for both kinds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from inferbus.timing import KV_LINKS, KvLink
from proto import messages as m

from .registry import WorkerRegistry, WorkerView
from .zones import prefer_zone

DEFAULT_TP = 2  # a prefill worker that does not report its tensor-parallel width


@dataclass(frozen=True)
class PairConfig:
    # The link a prefill engine sends a prompt's KV to its decode engine over (the timing model's, as
    # the simulated engine and the planner price it): RDMA between nodes by default, one 400 Gb/s
    # port per GPU; NVLink inside a node.
    link: KvLink = KV_LINKS["rdma"]
    # Cost (seconds) of a decode worker whose KV cache the request would fill: a full cache makes
    # the engine retract running requests or keep the new one waiting.
    decode_kv_weight_s: float = 0.5
    # A decode worker prefills a prompt itself only when it has at most this many uncached tokens
    # (Dynamo's conditional disaggregation decides on the prefill length likewise), and only where
    # that is cheaper than a prefill worker.
    local_prefill_max_tokens: int = 1024
    # Weight of the stall a local prefill puts on each stream the decode worker runs (a prefill
    # chunk in a decode step delays every token of that step), against the request's own wait.
    stall_weight: float = 1.0


@dataclass(frozen=True)
class Pair:
    """The answer: `decode` generates. `prefill` computes the prompt; None: `decode` does, either
    an aggregated worker or a decode worker prefilling locally (`local`)."""

    decode: WorkerView
    prefill: WorkerView | None
    prefill_cached_blocks: int = 0  # leading blocks the prefill worker (or a local prefill's decode worker) holds
    local: bool = False
    cost_s: float = 0.0  # the option's estimated cost, for the reply's reason and the tests
    remote_s: float | None = None  # the best remote pair's cost where a local prefill was priced against it
    local_s: float | None = None

    @property
    def reason(self) -> str:
        if self.prefill is not None:
            return "pair"
        return "local_prefill" if self.local else "aggregated"


class PairPolicy:
    """Chooses pairs (and prefill workers for decode workers that ask) from the registry."""

    name = "pair"

    def __init__(self, registry: WorkerRegistry, config: PairConfig | None = None,
                 rng: random.Random | None = None) -> None:
        self.registry = registry
        self.config = config or PairConfig()
        self.rng = rng or random.Random()

    # ---- the halves' costs -------------------------------------------------------------------

    def _matched(self, request: m.PlacementRequest) -> dict[str, int]:
        routing = self.registry.config
        if not request.block_hashes or request.block_size != routing.block_size:
            return {}
        return self.registry.index.matched_blocks(request.block_hashes)

    def prefill_costs(self, request: m.PlacementRequest, views: list[WorkerView],
                      matched: dict[str, int]) -> list[float]:
        """The affinity cost of computing the prompt on each of `views` (seconds): queued prefill,
        load and share (`base_cost`), the uncached tokens at `miss_weight`, the adapter's part."""
        routing = self.registry.config
        per_token = routing.miss_weight / routing.prefill_tokens_per_s
        prompt, block = request.prompt_tokens, routing.block_size
        costs = [view.base_cost + per_token * max(0, prompt - block * matched.get(view.worker_id, 0)) for view in views]
        slots = self.registry.adapter_slots
        if views and (request.adapter or (views[0].max_adapters and slots.lora_seen)):
            extra = slots.costs(request.adapter, [(view.worker_id, view.max_adapters, view.adapters) for view in views])
            costs = [cost + more for cost, more in zip(costs, extra)]
        return costs

    def decode_cost(self, request: m.PlacementRequest, view: WorkerView) -> float:
        """Decoding on `view` (seconds): its load per slot, and how full the request leaves its KV."""
        routing = self.registry.config
        load = routing.decode_weight_s * (view.reported_load + view.backlog()) / view.max_running
        capacity = view.kv_capacity_tokens
        fill = (view.kv_used_tokens + request.prompt_tokens) / capacity if capacity else view.kv_usage
        return load + self.config.decode_kv_weight_s * min(fill, 2.0)

    def has_kv_room(self, request: m.PlacementRequest, view: WorkerView) -> bool:
        """Whether `view`'s KV cache can take the prompt now (unknown capacity: assumed so)."""
        return not view.kv_capacity_tokens or view.kv_used_tokens + request.prompt_tokens <= view.kv_capacity_tokens

    def transfer_s(self, request: m.PlacementRequest, prefill: WorkerView, decode: WorkerView,
                   decode_cached: int = 0) -> float:
        """Moving the prompt's KV from the prefill engine to the decode engine, each GPU sending or
        receiving its share on its own link (the side with fewer GPUs sets the pace): every prompt
        token's KV, cached on the prefill side or not, except what the decode engine's own prefix
        cache holds (`decode_cached` tokens; SGLang's decode engines keep none unless started with a
        radix cache)."""
        return self.config.link.transfer_s(max(0, request.prompt_tokens - decode_cached), prefill.tp or DEFAULT_TP,
                                           decode.tp or DEFAULT_TP)

    def local_cost(self, request: m.PlacementRequest, view: WorkerView, matched: dict[str, int]) -> float | None:
        """A decode worker computing the prompt itself (seconds), or None where it may not: it
        cannot, or the uncached remainder is longer than `local_prefill_max_tokens`."""
        if not view.local_prefill:
            return None
        routing = self.registry.config
        uncached = max(0, request.prompt_tokens - routing.block_size * matched.get(view.worker_id, 0))
        if uncached > self.config.local_prefill_max_tokens:
            return None
        compute = uncached / routing.prefill_tokens_per_s
        # Its own compute weighs like a miss anywhere; the stall falls on every stream it runs.
        return compute * (routing.miss_weight + self.config.stall_weight * (view.running + view.backlog()))

    # ---- choices ----------------------------------------------------------------------------

    def choose_prefill(self, request: m.PlacementRequest, views: list[WorkerView]) -> tuple[WorkerView, int] | None:
        """A prefill worker for a request a decode worker holds (`PlacementRequest.role` "prefill"):
        the affinity choice among the prefill workers of the request's zone (the decode worker's)
        that are not in `request.avoid`."""
        avoid = set(request.avoid)
        prefills = prefer_zone([v for v in views if v.role == "prefill" and v.worker_id not in avoid], request.zone)
        if not prefills:
            return None
        matched = self._matched(request)
        chosen = prefills[self._softmax_pick(self.prefill_costs(request, prefills, matched))]
        return chosen, matched.get(chosen.worker_id, 0)

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> Pair | None:
        """The cheapest option for `request` among `candidates` (the registry's filtered workers
        of every role): a (prefill, decode) pair in one zone, a decode worker prefilling locally,
        or an aggregated worker. None when no option exists (decode workers without any prefill
        worker to pair with, and no aggregated one)."""
        candidates = prefer_zone([v for v in candidates if v.worker_id not in set(request.avoid)], request.zone)
        matched = self._matched(request)
        prefills = [v for v in candidates if v.role == "prefill"]
        decodes = [v for v in candidates if v.role == "decode"]
        roomy = [v for v in decodes if self.has_kv_room(request, v)]
        decodes = roomy or decodes
        options: list[Pair] = []
        if decodes:
            prefill_costs = dict(zip((v.worker_id for v in prefills), self.prefill_costs(request, prefills, matched)))
            # The best prefill worker per zone: a pair's two halves share one zone while it has both.
            best_prefill: dict[str, WorkerView] = {}
            for view in prefills:
                best = best_prefill.get(view.zone)
                if best is None or prefill_costs[view.worker_id] < prefill_costs[best.worker_id]:
                    best_prefill[view.zone] = view
            overall = min(prefills, key=lambda v: prefill_costs[v.worker_id]) if prefills else None
            for decode in decodes:
                prefill = best_prefill.get(decode.zone, overall)
                decode_s = self.decode_cost(request, decode)
                remote = None
                if prefill is not None:
                    cached_there = self.registry.config.block_size * matched.get(decode.worker_id, 0)
                    remote = (
                        prefill_costs[prefill.worker_id]
                        + self.transfer_s(request, prefill, decode, cached_there)
                        + decode_s
                    )
                local = self.local_cost(request, decode, matched)
                if local is not None and (remote is None or local + decode_s < remote):
                    options.append(Pair(decode, None, matched.get(decode.worker_id, 0), local=True,
                                        cost_s=local + decode_s, remote_s=remote, local_s=local + decode_s))
                elif prefill is not None and remote is not None:
                    options.append(Pair(decode, prefill, matched.get(prefill.worker_id, 0), cost_s=remote,
                                        remote_s=remote, local_s=None if local is None else local + decode_s))
        aggregated = [v for v in candidates if v.role == "aggregated"]
        if aggregated:
            for view, cost in zip(aggregated, self.prefill_costs(request, aggregated, matched)):
                options.append(Pair(view, None, matched.get(view.worker_id, 0), cost_s=cost))
        if not options:
            return None
        return options[self._softmax_pick([option.cost_s for option in options])]

    def _softmax_pick(self, costs: list[float]) -> int:
        """As every policy draws (`policies.base`): weight exp(-(cost - best) / temperature)."""
        best = min(costs)
        temperature = max(self.registry.config.temperature, 1e-9)
        near = [i for i, cost in enumerate(costs) if cost <= best + 10 * temperature]
        if len(near) == 1:
            return near[0]
        weights = [math.exp((best - costs[i]) / temperature) for i in near]
        return self.rng.choices(near, weights)[0]
