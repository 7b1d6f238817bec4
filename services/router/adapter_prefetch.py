"""Which registered LoRA adapters to load into engines' host memory before anyone asks for them,
and where. Pure, with an injected clock: the router's prefetch loop and its tests run the same code.

SGLang keeps the adapters it has loaded in host memory (its CPU-side cache, at most
`--max-loaded-loras`) and copies one into a GPU slot when a batch needs it; an adapter not loaded
is read from disk first, ~0.3 s for rank 16 on a 70B, one load at a time per engine. With hundreds
of adapters, a tail adapter's first request pays that read, queued behind other first reads: at
1,000 adapters on 4 engines the first reads alone can outrun what the engines load. An engine that
bounds its host memory (a cap in the heartbeat, `max_loaded_adapters`) has room for adapters nobody
asked for yet, and filling it ahead of traffic turns those first requests into hits. Rules:

- Only engines with a cap: without one the platform knows no bound on host memory.
- An adapter is prefetched where no worker has it loaded or loading: one copy in the fleet (its
  traffic opens more homes, adapter_slots.py). Recently requested adapters first (an evicted one
  someone still uses), then the rest in an order of their names' hash (no popularity is known).
- Its worker: of those with room (loaded, loading and prefetching below the cap), the first by a
  rendezvous hash of adapter and worker, so adapters spread evenly, every router replica picks the
  same worker, and a worker joining or leaving moves only its own share.
- At most `per_worker` prefetches queued or loading per worker; the worker loads them only while no
  load a request waits for is queued (`ControlCommand.background`), so such a load waits behind at
  most one prefetch, and the cap is never passed, so prefetching never evicts.
- A prefetch asked for counts as under way until the worker lists the adapter as loaded, or for
  `ttl_s` (then it may be asked for again; the worker does not load twice).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefetchWorker:
    worker_id: str
    cap: int  # adapters its engine keeps in host memory before evicting (0: no cap, not prefetched to)
    loaded: frozenset[str]
    loading: Collection[str] = ()  # loads queued or under way that requests wait for
    prefetches: int = 0  # prefetches it reported queued or loading


def _rank(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class Prefetcher:
    clock: Callable[[], float]
    per_worker: int = 1
    ttl_s: float = 60.0
    asked: dict[str, tuple[str, float]] = field(default_factory=dict)  # adapter → (worker, when)

    def plan(self, registered: Iterable[str], workers: list[PrefetchWorker],
             share: Callable[[str], float] = lambda _: 0.0) -> list[tuple[str, str]]:
        """(worker, adapter) prefetches to ask for now; they count as asked for."""
        now = self.clock()
        loaded_anywhere = set().union(*(w.loaded for w in workers)) if workers else set()
        self.asked = {
            a: (w, at) for a, (w, at) in self.asked.items() if a not in loaded_anywhere and now - at < self.ttl_s
        }
        capped = [w for w in workers if w.cap > 0]
        if not capped:
            return []
        held = loaded_anywhere | set(self.asked) | set().union(*(set(w.loading) for w in workers))
        asked_per_worker = Counter(w for w, _ in self.asked.values())
        busy = {w.worker_id: max(w.prefetches, asked_per_worker[w.worker_id]) for w in capped}
        room = {w.worker_id: w.cap - len(w.loaded) - len(w.loading) - busy[w.worker_id] for w in capped}
        out: list[tuple[str, str]] = []
        candidates = sorted((a for a in set(registered) if a not in held), key=lambda a: (-share(a), _rank(a)))
        for adapter in candidates:
            free = [w.worker_id for w in capped if room[w.worker_id] > 0]
            if not free or all(busy[w] >= self.per_worker for w in free):
                break
            target = max(free, key=lambda w: _rank(f"{adapter}\x00{w}"))
            if busy[target] >= self.per_worker:
                continue  # its worker is busy: asked for on a later pass
            out.append((target, adapter))
            self.asked[adapter] = (target, now)
            busy[target] += 1
            room[target] -= 1
        return out
