"""What a LoRA adapter adds to a worker's cost, and on how many workers a hot adapter may run.

Pure, with an injected clock: the router's affinity policy, its tests and the fleet simulator call
the same code.

An engine runs at most `max_adapters` distinct adapters in one batch, the base model counting as
one (SGLang's `--max-loras-per-batch`, in the worker's heartbeat). A request whose adapter is not
in the batch while every slot is taken waits until one adapter's requests have all finished,
however idle the engine is otherwise. So the adapter part of a worker's cost is

    [not one of the adapter's homes, and they take no newcomer] · away_s
    + the expected wait for the adapter's load there (see below), or, if it is loaded (or the
      request is for the base model), for the load under way there (`stall`)
    + [the adapter neither loaded nor loading there] · one load, for the batches its load stops
    + [its adapter not in the batch and no slot free] · slot_hold_s · (H(k) + overflow)
    + balance_s · max(0, the worker's recent placements ÷ the mean − 1)

where the batch is what the worker last reported holding per adapter (`WorkerLoad.adapter_requests`)
plus what routers placed there since; k is the fewest requests any adapter of the batch holds (the
slot frees when the last of them finishes: for k requests with exponentially distributed remaining
times of mean `slot_hold_s`, the expected longest is `slot_hold_s` · H(k), H the harmonic number),
and overflow the number of adapters already waiting there for a slot (each takes one first).

**Loads.** An engine loads one adapter at a time, so a request for an adapter not loaded waits
for every load queued there and then its own. SGLang reads the weights inside its scheduler's
loop, so while it does no batch runs there: every other request on that worker waits for the load
under way too. A placement that makes a worker load its adapter therefore costs that load
twice: once for the request, once for everyone else's batches there; so a request waits for a
home busy with another load rather than start a load elsewhere, unless the home's queue is long. Workers report their
queued and in-flight loads with the expected seconds until each is ready, and their expected seconds for one more load
(`WorkerLoad.adapter_loads`, `adapter_load_s`; worker/adapter_loads.py); loads this router asked
for since (a placement on a worker without the adapter, a warm-up) count `adapter_load_s` each
until a report shows them. The wait for adapter a on a worker is then: 0 if loaded there; the
reported time left if it is queued there; else the reported queue plus the loads asked for since
plus one load (`load_s` before the worker has measured one).

**Homes.** Each adapter has a set of workers it is meant to run on. Its size follows the adapter's
share of recent placements (an exponentially decayed count, half-life `share_half_life_s`):
`ceil(share · workers · spread)`, at least one (one while fewer than `MIN_PLACEMENTS` requests
were seen recently). While the set is smaller than that, any worker may
join it without the `away_s` penalty, and every worker a request is placed on joins. Traffic does
not move to a worker before the adapter is loaded there (it would wait for the load): while the
homes take newcomers and no other worker holds or is loading the adapter, `warm_target` names
the worker with the least balance excess and load queue, and the router asks it to load the
adapter in the background; its cost drops once it reports it loaded. When the share falls, the
set shrinks after the
smaller size has held for `release_after_s`, dropping the home placed on least recently; the
adapter stays loaded there (a cheap choice, `away_s`) until the engine evicts it. Homes also open
when every one of them has had more than `crowded` (10%) above the mean of recent placements
(decayed like the shares, once workers average `MIN_PLACEMENTS`): a tail adapter pinned to a
busy worker then moves some of its traffic to a quieter one, which the balance term prefers. But a
new home's load stops that engine's batches for its read (and on a worker whose engine caps its
loaded adapters, `--max-loaded-loras` in the heartbeat, it evicts another adapter once the engine
is full, whose next request reads it from disk again): so crowding opens a home where the adapter
is not loaded only when what the copy gains outweighs what its read costs. It gains, over the
`release_after_s` it is kept at least, its part of the adapter's traffic (one of homes + 1) times
the balance price of the gap between the homes' mean excess and its own; its read costs one load
for every request running or queued there, and the one that follows. The copies that balance
the load are of adapters that use them, and the tail stays on one worker each. So the hottest
adapter, which would otherwise be pinned to the one worker that loaded it first (a load penalty
far larger than any load difference), spreads over as many workers as its traffic needs, and
tail adapters stay on one.

Every time here is in engine seconds: with simulated engines slowed down (`time_scale` wall
seconds per engine second) the clock and the workers' measured load times are divided by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

BASE = ""  # the base model's key in a worker's per-adapter counts
MIN_PLACEMENTS = 20.0  # recent placements per worker, on average, before balance counts
# A load asked for that no report has shown after this long is not counted any more (the command
# was lost, or the load failed and was answered to the request that asked).
ASKED_TTL_S = 5.0


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
    # every home is more than `crowded` above the mean may take a new home (where it is not
    # loaded, only if the moved traffic pays for the read: see the module's docstring).
    balance_s: float = 0.5
    crowded: float = 0.1
    # Wall seconds per engine second: with engines slowed down, the clock and the workers'
    # measured load times (wall seconds) are read in engine seconds, which every cost here is in.
    time_scale: float = 1.0


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
    # Per worker: its reported loads (adapter → seconds until ready), when it reported them, its
    # expected seconds for one load, and loads this router asked for since (adapter → when).
    loading: dict[str, dict[str, float]] = field(default_factory=dict)
    reported_at: dict[str, float] = field(default_factory=dict)
    worker_load_s: dict[str, float] = field(default_factory=dict)
    asked: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per worker: its engine's cap on loaded adapters (0: none), from its heartbeat.
    caps: dict[str, int] = field(default_factory=dict)
    # Whether any adapter request was seen: until then base-model requests skip the slot estimate
    # (every batch has room for the base model), which keeps base-only placement as cheap as before.
    lora_seen: bool = False

    def __post_init__(self) -> None:
        # 0 (engines stepping back to back) has no fixed ratio: read wall seconds then.
        self._scale = self.config.time_scale if self.config.time_scale > 0 else 1.0
        if self._scale != 1.0:
            wall, scale = self.clock, self._scale
            self.clock = lambda: wall() / scale

    # ---- events -------------------------------------------------------------------------------

    def on_load(self, worker_id: str, adapter_requests: dict[str, int], adapter_loads: dict[str, float] | None = None,
                adapter_load_s: float = 0.0, loaded: frozenset[str] = frozenset()) -> None:
        """A worker's load report: requests per adapter, loads queued there, adapters loaded."""
        now = self.clock()
        self.reported[worker_id] = dict(adapter_requests)
        if not self.lora_seen and any(adapter_requests.keys() - {BASE}):
            self.lora_seen = True
        self.placed.pop(worker_id, None)  # the report counts them now (or they finished)
        scale = self._scale
        self.loading[worker_id] = {name: left / scale for name, left in (adapter_loads or {}).items()}
        self.reported_at[worker_id] = now
        if adapter_load_s > 0:
            self.worker_load_s[worker_id] = adapter_load_s / scale
        asked = self.asked.get(worker_id)
        if asked:  # the report shows them now, or they were asked for too long ago to still be on their way
            self.asked[worker_id] = {name: at for name, at in asked.items() if name not in self.loading[worker_id]
                                     and name not in loaded and now - at < ASKED_TTL_S}

    def on_placed(self, worker_id: str, adapter: str | None, loaded: frozenset[str] | None = None) -> None:
        """A placement by this router or a replica; `loaded`: the adapters loaded there (None:
        unknown), so a placement that makes the worker load its adapter counts as a load asked for."""
        counts = self.placed.setdefault(worker_id, {})
        key = adapter or BASE
        counts[key] = counts.get(key, 0) + 1
        now = self.clock()
        self._bump(self._worker_placed.setdefault(worker_id, _Share(at=now)), now)
        if adapter:
            self.homes.setdefault(adapter, _Homes()).workers[worker_id] = now
            if loaded is not None and adapter not in loaded and not self._loading(worker_id, adapter):
                self._ask_load(worker_id, adapter)

    def on_cap(self, worker_id: str, cap: int) -> None:
        """The worker's engine keeps at most `cap` adapters loaded (0: no cap)."""
        self.caps[worker_id] = cap

    def on_worker_gone(self, worker_id: str) -> None:
        self.caps.pop(worker_id, None)
        self.reported.pop(worker_id, None)
        self.placed.pop(worker_id, None)
        self._worker_placed.pop(worker_id, None)
        self.loading.pop(worker_id, None)
        self.reported_at.pop(worker_id, None)
        self.worker_load_s.pop(worker_id, None)
        self.asked.pop(worker_id, None)
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
        if self._decayed(self._total, self.clock()) < MIN_PLACEMENTS:
            return 1  # a handful of requests tell no share: not worth loading it elsewhere
        return max(1, min(workers, math.ceil(self.share(adapter) * workers * self.config.spread - 1e-9)))

    def costs(self, adapter: str | None, workers: list[tuple[str, int, frozenset[str]]]) -> list[float]:
        """The adapter part of each worker's cost, in seconds. `workers`: (worker id, distinct
        adapters per batch or 0 when unknown, adapters loaded there)."""
        config = self.config
        homes = self._homes_for(adapter, len(workers)) if adapter else {}
        excess = self.excess([worker_id for worker_id, _, _ in workers]) if adapter else {}
        opening = self._opening(adapter, homes, excess, len(workers)) if adapter else None
        moved = self._moved(adapter, homes) if adapter and opening == "crowded" else 0.0
        key = adapter or BASE
        out = []
        for worker_id, slots, loaded in workers:
            cost = config.balance_s * max(0.0, excess.get(worker_id, 0.0))
            if adapter and adapter not in loaded:
                cost += self.load_wait(worker_id, adapter, loaded)
                if not self._loading(worker_id, adapter):
                    cost += self._one_load(worker_id)  # the load it asks for stops everyone's batches there
            else:
                cost += self.stall(worker_id, loaded)
            if adapter:
                if worker_id not in homes and not self._takes(
                    opening, worker_id, adapter, loaded, homes, excess, moved
                ):
                    cost += config.away_s
            if slots:
                cost += self.slot_wait(worker_id, key, slots)
            out.append(cost)
        return out

    def warm_target(self, adapter: str, workers: list[tuple[str, int, frozenset[str]]]) -> str | None:
        """The worker to load `adapter` on in the background now, if any: its homes take a newcomer
        and no worker outside them holds or is loading it. Counted as a load asked for there."""
        homes = self._homes_for(adapter, len(workers))
        excess = self.excess([worker_id for worker_id, _, _ in workers])
        opening = self._opening(adapter, homes, excess, len(workers))
        if opening is None:
            return None
        outside = [(worker_id, loaded) for worker_id, _, loaded in workers if worker_id not in homes]
        if any(adapter in loaded or self._loading(worker_id, adapter) for worker_id, loaded in outside):
            return None
        moved = self._moved(adapter, homes) if opening == "crowded" else 0.0
        outside = [(worker_id, loaded) for worker_id, loaded in outside
                   if self._takes(opening, worker_id, adapter, loaded, homes, excess, moved)]
        if not outside:
            return None
        def cost(worker_id: str, loaded: frozenset[str]) -> float:
            return self.config.balance_s * max(0.0, excess.get(worker_id, 0.0)) + self.load_wait(
                worker_id, adapter, loaded
            )

        best = min(outside, key=lambda w: cost(*w))[0]
        self._ask_load(best, adapter)
        return best

    def load_wait(self, worker_id: str, adapter: str, loaded: frozenset[str]) -> float:
        """Expected seconds before `adapter` is loaded on this worker (0: it is)."""
        if adapter in loaded:
            return 0.0
        now = self.clock()
        age = now - self.reported_at.get(worker_id, now)
        reported = self.loading.get(worker_id, {})
        left = reported.get(adapter)
        if left is not None:
            return max(0.0, left - age)
        one = self._one_load(worker_id)
        queue = max(0.0, max(reported.values(), default=0.0) - age)
        asked = [name for name in self.asked.get(worker_id, {}) if name not in reported and name not in loaded]
        ahead = asked.index(adapter) if adapter in asked else len(asked)
        return queue + one * (ahead + 1)

    def stall(self, worker_id: str, loaded: frozenset[str]) -> float:
        """Expected seconds before the worker's engine runs a batch again. It reads an adapter from
        disk inside its scheduler's loop, so a request that needs no load still waits for the load
        under way; the worker sends the next load only after that one's answer, and the engine runs
        a batch in between."""
        reported = self.loading.get(worker_id)
        if reported:
            now = self.clock()
            return max(0.0, min(reported.values()) - (now - self.reported_at.get(worker_id, now)))
        if any(name not in loaded for name in self.asked.get(worker_id, ())):
            return self._one_load(worker_id)  # asked for, not reported yet
        return 0.0

    def _one_load(self, worker_id: str) -> float:
        """Expected seconds of one more load on this worker (the default before it measured one)."""
        return self.worker_load_s.get(worker_id) or self.config.load_s

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

    def _opening(self, adapter: str, homes: dict[str, float], excess: dict[str, float], workers: int) -> str | None:
        """Why the adapter's homes take a newcomer, if they do: "share" (fewer than its share asks
        for) or "crowded" (every one has more than its share of the placements). An adapter with
        none yet goes where it is loaded, if anywhere (its first home)."""
        if not homes:
            return None
        if len(homes) < self.wanted_homes(adapter, workers):
            return "share"
        if all(excess.get(w, 0.0) > self.config.crowded for w in homes):
            return "crowded"
        return None

    def _takes(self, opening: str | None, worker_id: str, adapter: str, loaded: frozenset[str],
               homes: dict[str, float], excess: dict[str, float], moved: float) -> bool:
        """Whether `worker_id` may become a home of `adapter` now. For crowding, a worker takes an
        adapter it holds already, or one whose moved traffic (`moved`, from `_moved`) pays for the
        read that would stop its engine's batches (and, on a capped engine, evict another adapter)."""
        if opening != "crowded" or adapter in loaded:
            return opening is not None
        return self._gain(moved, worker_id, homes, excess) > self.copy_cost(worker_id)

    def copy_gain(self, adapter: str, worker_id: str, homes: dict[str, float], excess: dict[str, float]) -> float:
        """Seconds a new home on `worker_id` saves the adapter's requests while it is kept: the
        requests it takes (its part of the adapter's traffic over `release_after_s`) times the
        balance price of the gap between its homes' mean excess and this worker's."""
        return self._gain(self._moved(adapter, homes), worker_id, homes, excess)

    def _moved(self, adapter: str, homes: dict[str, float]) -> float:
        """Requests a new home would take while it is kept (the same for every candidate worker)."""
        now = self.clock()
        placed = sum(self._decayed(entry, now) for entry in self._worker_placed.values())
        # A decayed count of a steady rate r is r · half-life / ln 2.
        rate = self.share(adapter) * placed * math.log(2) / self.config.share_half_life_s
        return rate * self.config.release_after_s / (len(homes) + 1)

    def _gain(self, moved: float, worker_id: str, homes: dict[str, float], excess: dict[str, float]) -> float:
        gap = sum(excess.get(w, 0.0) for w in homes) / len(homes) - excess.get(worker_id, 0.0)
        return moved * self.config.balance_s * max(0.0, gap)

    def copy_cost(self, worker_id: str) -> float:
        """Seconds a read on `worker_id` costs the requests there: one load for each request it
        holds (running or queued), and for the next one."""
        return self._one_load(worker_id) * (sum(self._batch(worker_id).values()) + 1)

    def _loading(self, worker_id: str, adapter: str) -> bool:
        return adapter in self.loading.get(worker_id, {}) or adapter in self.asked.get(worker_id, {})

    def _ask_load(self, worker_id: str, adapter: str) -> None:
        self.asked.setdefault(worker_id, {})[adapter] = self.clock()

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
