"""What a LoRA adapter adds to a worker's cost, and on how many workers a hot adapter may run.

Pure, with an injected clock: the router's affinity policy, its tests and the fleet simulator call
the same code.

An engine runs at most `max_adapters` distinct adapters in one batch, the base model counting as
one (SGLang's `--max-loras-per-batch`, in the worker's heartbeat). A request whose adapter is not
in the batch while every slot is taken waits until one adapter's requests have all finished,
however idle the engine is otherwise. So the adapter part of a worker's cost is

    [not one of the adapter's homes] · (away_s if loaded there, else load_s)
    + [its adapter not in the batch and no slot free] · slot_hold_s · (H(k) + overflow)
    + balance_s · max(0, the worker's recent placements ÷ the mean − 1)

where the batch is what the worker last reported holding per adapter (`WorkerLoad.adapter_requests`)
plus what routers placed there since; k is the fewest requests any adapter of the batch holds (the
slot frees when the last of them finishes: for k requests with exponentially distributed remaining
times of mean `slot_hold_s`, the expected longest is `slot_hold_s` · H(k), H the harmonic number),
and overflow the number of adapters already waiting there for a slot (each takes one first).

**Homes.** Each adapter has a set of workers it is meant to run on. Its size follows the adapter's
share of recent placements (an exponentially decayed count, half-life `share_half_life_s`):
`ceil(share · workers · spread)`, at least one. While the set is smaller than that, any worker may
join it (no load penalty; `away_s` where the adapter is not loaded yet, so a worker that has it
wins a tie), and every worker a request is placed on joins; a router that places there tells the
worker to load the adapter at once. When the share falls, the set shrinks after the
smaller size has held for `release_after_s`, dropping the home placed on least recently; the
adapter stays loaded there (a cheap choice, `away_s`) until the engine evicts it. Homes also open
when every one of them has had more than `crowded` (10%) above the mean of recent placements
(decayed like the shares, once workers average `MIN_PLACEMENTS`): a tail adapter pinned to a
busy worker then moves some of its traffic to a quieter one, which the balance term prefers. So the hottest
adapter, which would otherwise be pinned to the one worker that loaded it first (a load penalty
far larger than any load difference), spreads over as many workers as its traffic needs, and
tail adapters stay on one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

BASE = ""  # the base model's key in a worker's per-adapter counts
MIN_PLACEMENTS = 20.0  # recent placements per worker, on average, before balance counts


@dataclass(frozen=True)
class AdapterConfig:
    load_s: float = 0.5  # a worker that must load the adapter first
    away_s: float = 0.05  # a worker that has it loaded but is no longer one of its homes
    # How long a running request keeps its adapter's batch slot, on average (a chat answer of a
    # few hundred tokens at 20-40 ms per token is a few seconds).
    slot_hold_s: float = 2.0
    share_half_life_s: float = 30.0
    spread: float = 2.0  # homes per worker-equivalent of traffic
    release_after_s: float = 30.0
    # Balance: a worker placed on more than the mean (decayed placement counts, the share's
    # half-life) costs balance_s per 100% above it, for adapter requests; and an adapter whose
    # every home is more than `crowded` above the mean may take a new home.
    balance_s: float = 0.5
    crowded: float = 0.1


def harmonic(k: int) -> float:
    return sum(1.0 / i for i in range(1, k + 1))


@dataclass
class _Share:
    count: float = 0.0
    at: float = 0.0


@dataclass
class _Homes:
    workers: dict[str, float] = field(default_factory=dict)  # worker → last placement there
    smaller_since: float | None = None  # since when fewer homes would do


@dataclass
class AdapterSlots:
    clock: Callable[[], float]
    config: AdapterConfig = field(default_factory=AdapterConfig)
    # Per worker: requests per adapter it reported holding, and placements there since.
    reported: dict[str, dict[str, int]] = field(default_factory=dict)
    placed: dict[str, dict[str, int]] = field(default_factory=dict)
    homes: dict[str, _Homes] = field(default_factory=dict)
    _shares: dict[str, _Share] = field(default_factory=dict)
    _total: _Share = field(default_factory=_Share)
    _worker_placed: dict[str, _Share] = field(default_factory=dict)  # decayed placements per worker
    # Whether any adapter request was seen: until then base-model requests skip the slot estimate
    # (every batch has room for the base model), which keeps base-only placement as cheap as before.
    lora_seen: bool = False

    # ---- events -------------------------------------------------------------------------------

    def on_load(self, worker_id: str, adapter_requests: dict[str, int]) -> None:
        self.reported[worker_id] = dict(adapter_requests)
        if not self.lora_seen and any(adapter_requests.keys() - {BASE}):
            self.lora_seen = True
        self.placed.pop(worker_id, None)  # the report counts them now (or they finished)

    def on_placed(self, worker_id: str, adapter: str | None) -> None:
        """A placement by this router or a replica."""
        counts = self.placed.setdefault(worker_id, {})
        key = adapter or BASE
        counts[key] = counts.get(key, 0) + 1
        now = self.clock()
        self._bump(self._worker_placed.setdefault(worker_id, _Share(at=now)), now)
        if adapter:
            self.homes.setdefault(adapter, _Homes()).workers[worker_id] = self.clock()

    def on_worker_gone(self, worker_id: str) -> None:
        self.reported.pop(worker_id, None)
        self.placed.pop(worker_id, None)
        self._worker_placed.pop(worker_id, None)
        for homes in self.homes.values():
            homes.workers.pop(worker_id, None)

    def observe(self, adapter: str | None) -> None:
        """A request arrived (adapter None: the base model): update the traffic shares."""
        now = self.clock()
        self._bump(self._total, now)
        if adapter:
            self.lora_seen = True
            self._bump(self._shares.setdefault(adapter, _Share(at=now)), now)

    # ---- placement ----------------------------------------------------------------------------

    def share(self, adapter: str) -> float:
        now = self.clock()
        total = self._decayed(self._total, now)
        entry = self._shares.get(adapter)
        return self._decayed(entry, now) / total if entry is not None and total > 0 else 0.0

    def wanted_homes(self, adapter: str, workers: int) -> int:
        return max(1, min(workers, math.ceil(self.share(adapter) * workers * self.config.spread - 1e-9)))

    def costs(self, adapter: str | None, workers: list[tuple[str, int, frozenset[str]]]) -> list[float]:
        """The adapter part of each worker's cost, in seconds. `workers`: (worker id, distinct
        adapters per batch or 0 when unknown, adapters loaded there)."""
        config = self.config
        homes = self._homes_for(adapter, len(workers)) if adapter else None
        excess = self.excess([worker_id for worker_id, _, _ in workers]) if adapter else {}
        # Homes are open to newcomers while fewer than the share asks for, or while every home has
        # more than its share of the placements; an adapter with none yet goes where it is loaded,
        # if anywhere (its first home).
        open_homes = homes is not None and bool(homes) and (
            len(homes) < self.wanted_homes(adapter or "", len(workers))
            or all(excess.get(w, 0.0) > config.crowded for w in homes))
        key = adapter or BASE
        out = []
        for worker_id, slots, loaded in workers:
            cost = config.balance_s * max(0.0, excess.get(worker_id, 0.0))
            if adapter and worker_id not in homes:  # type: ignore[operator]
                if open_homes:  # it may join the homes: prefer where it is loaded already
                    cost += 0.0 if adapter in loaded else config.away_s
                else:
                    cost += config.away_s if adapter in loaded else config.load_s
            if slots:
                cost += self.slot_wait(worker_id, key, slots)
            out.append(cost)
        return out

    def excess(self, worker_ids: list[str]) -> dict[str, float]:
        """Each worker's recent placements relative to the mean over `worker_ids`, minus one."""
        now = self.clock()
        rates = {w: self._decayed(self._worker_placed.get(w), now) for w in worker_ids}
        mean = sum(rates.values()) / len(rates) if rates else 0.0
        if mean < MIN_PLACEMENTS:  # too few placements yet to tell
            return {}
        return {w: rate / mean - 1.0 for w, rate in rates.items()}

    def slot_wait(self, worker_id: str, key: str, slots: int) -> float:
        """Expected seconds a request for `key` waits for a batch slot on this worker."""
        batch = self._batch(worker_id)
        if batch.get(key, 0) > 0:
            return 0.0
        holding = [n for n in batch.values() if n > 0]
        if len(holding) < slots:
            return 0.0
        overflow = len(holding) - slots  # adapters already waiting there for a slot
        return self.config.slot_hold_s * (harmonic(min(holding)) + overflow)

    # ---- internals ----------------------------------------------------------------------------

    def _batch(self, worker_id: str) -> dict[str, int]:
        reported = self.reported.get(worker_id, {})
        placed = self.placed.get(worker_id)
        if not placed:
            return reported
        merged = dict(reported)
        for key, count in placed.items():
            merged[key] = merged.get(key, 0) + count
        return merged

    def _homes_for(self, adapter: str, workers: int) -> dict[str, float]:
        entry = self.homes.setdefault(adapter, _Homes())
        wanted = self.wanted_homes(adapter, workers)
        now = self.clock()
        if len(entry.workers) > wanted:
            if entry.smaller_since is None:
                entry.smaller_since = now
            elif now - entry.smaller_since >= self.config.release_after_s:
                for worker_id in sorted(entry.workers, key=entry.workers.__getitem__)[: len(entry.workers) - wanted]:
                    del entry.workers[worker_id]  # released: placed on least recently
                entry.smaller_since = None
        else:
            entry.smaller_since = None
        return entry.workers

    def _decayed(self, share: _Share | None, now: float) -> float:
        if share is None:
            return 0.0
        return share.count * 0.5 ** ((now - share.at) / self.config.share_half_life_s)

    def _bump(self, share: _Share, now: float) -> None:
        share.count = self._decayed(share, now) + 1.0
        share.at = now
