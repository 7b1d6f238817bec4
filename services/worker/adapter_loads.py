"""The LoRA adapter loads queued on one worker's engine, and when each will be ready. Pure, with an
injected clock: the worker's adapter shell feeds it, its load report carries `expected()` to the
routers (`WorkerLoad.adapter_loads`), whose placement cost counts it (router/adapter_slots.py).

The engine loads one adapter at a time (SGLang 0.5.23 serialises `/load_lora_adapter` behind one
lock in its tokenizer manager, and its scheduler reads the weights from disk into host memory;
the worker also sends one load at a time so that each answer's list of loaded adapters is current).
A request for an adapter in the queue therefore waits for every load ahead of it, and one for an
adapter not loaded and not queued waits for the whole queue and its own load.

How long one load takes depends on the adapter's size and where the engine reads it from. The
estimate is learned from the loads measured here (disk or object store as configured, the
engine's parsing, and the worker's verification): an exponentially weighted mean of seconds per
load, and of bytes per second (fixed costs included) for adapters whose size is known (a local
directory), so a large adapter is expected to take longer than a small one. Before any load is measured, `default_s`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

EWMA_WEIGHT = 0.3  # of the latest measured load in the running means


@dataclass
class _Queued:
    name: str
    size_bytes: int | None
    background: bool = False  # a prefetch: loaded only when no other load is queued


@dataclass
class LoadQueue:
    clock: Callable[[], float]
    default_s: float = 0.5
    queued: list[_Queued] = field(default_factory=list)  # in the order the engine will load them
    current: _Queued | None = None
    started_at: float = 0.0
    mean_s: float | None = None  # seconds per load, measured
    bytes_per_s: float | None = None  # for adapters of known size, measured

    def enqueue(self, name: str, size_bytes: int | None = None, background: bool = False) -> None:
        """Queue a load of `name` (already queued: it keeps its place, learns its size if given, and
        a prefetch asked for by a request is one no longer)."""
        for entry in self.queued:
            if entry.name == name:
                entry.size_bytes = size_bytes or entry.size_bytes
                if entry.background and not background:  # behind the loads requests asked for before
                    entry.background = False
                    self.queued.remove(entry)
                    self.queued.append(entry)
                return
        if self.current is None or self.current.name != name:
            self.queued.append(_Queued(name, size_bytes, background))

    def set_size(self, name: str, size_bytes: int) -> None:
        for entry in self.queued:
            if entry.name == name:
                entry.size_bytes = size_bytes

    def in_turn(self) -> list[_Queued]:
        """The queue in the order loads start: those requests wait for first, then prefetches."""
        return [q for q in self.queued if not q.background] + [q for q in self.queued if q.background]

    def next_up(self) -> str | None:
        """Whose load starts when the engine is free."""
        order = self.in_turn()
        return order[0].name if order else None

    def start(self, name: str) -> None:
        """The engine starts loading `name` now (it leaves the queue, wherever it stood)."""
        entry = next((q for q in self.queued if q.name == name), None) or _Queued(name, None)
        self.queued = [q for q in self.queued if q.name != name]
        self.current = entry
        self.started_at = self.clock()

    def finish(self, name: str, measured: bool = True) -> None:
        """`name`'s load ended (measured: it succeeded, learn from its time); also drops it from the queue."""
        self.queued = [q for q in self.queued if q.name != name]
        if self.current is None or self.current.name != name:
            return
        seconds = max(0.0, self.clock() - self.started_at)
        size = self.current.size_bytes
        self.current = None
        if not measured:
            return
        self.mean_s = seconds if self.mean_s is None else (1 - EWMA_WEIGHT) * self.mean_s + EWMA_WEIGHT * seconds
        if size:
            rate = size / max(seconds, 1e-6)
            self.bytes_per_s = (rate if self.bytes_per_s is None
                                else (1 - EWMA_WEIGHT) * self.bytes_per_s + EWMA_WEIGHT * rate)

    def one_load_s(self, size_bytes: int | None = None) -> float:
        """Expected seconds of one load of an adapter of `size_bytes` (None: unknown size)."""
        if size_bytes and self.bytes_per_s:
            return size_bytes / self.bytes_per_s
        return self.mean_s if self.mean_s is not None else self.default_s

    def expected(self) -> dict[str, float]:
        """Adapter → expected seconds until it is loaded, the loads ahead of it included; queued
        prefetches are left out (nobody waits for them, and a request would go ahead of them)."""
        out: dict[str, float] = {}
        ahead = 0.0
        if self.current is not None:
            elapsed = self.clock() - self.started_at
            # A load running longer than expected is expected to end soon, not to have ended.
            one = self.one_load_s(self.current.size_bytes)
            ahead = max(one - elapsed, 0.1 * one)
            out[self.current.name] = round(ahead, 4)
        for entry in self.queued:
            if not entry.background:
                ahead += self.one_load_s(entry.size_bytes)
                out[entry.name] = round(ahead, 4)
        return out

    def prefetches(self) -> int:
        """Prefetches queued or in flight."""
        return sum(q.background for q in self.queued) + int(self.current is not None and self.current.background)

    def backlog_s(self) -> float:
        """Seconds until every queued load is done."""
        return max(self.expected().values(), default=0.0)
