"""LoRA adapters on this worker's engine: loaded on first use (or when the router asks), verified,
and kept in step with what the engine really holds.

Verification does not trust the load call's 200: some engines accept any path and fail only when
the adapter is first used, or serve the base model. After a load the adapter must be listed by the
engine and a one-token generation with it must succeed; otherwise it is unloaded and every
request for it fails with a clear error instead of running on weights nobody registered. An
adapter verified once on this engine process is not probed again when it is loaded again.

The engine decides what stays loaded: SGLang with `--max-loaded-loras` unloads its least recently
used adapter when a load goes past the cap, and loads an evicted one again by itself when a
request names it. This view follows the engine instead of guessing: every load answer lists what
is loaded (adapters missing from it were evicted), loads are made one at a time so those lists
arrive in order (the engine makes them one at a time anyway; the queue and its expected times go
into the load report, adapter_loads.py), and `resync` re-reads the engine's list (`/v1/models`) after a restart and now
and then, since an implicit reload can evict without any answer to this worker.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from inferbus.runtime import logs
from proto import messages as m

from . import release_check
from .adapter_loads import LoadQueue
from .engine import EngineClient, EngineError

log = logs.get(__name__)

# How often a worker whose engine evicts by itself (--max-loaded-loras) re-reads its list.
ADAPTER_RESYNC_S = 5.0

LOADS = Counter("inferbus_adapter_loads_total", "LoRA adapter loads this worker asked its engine for", ["result"])
EVICTIONS = Counter("inferbus_adapter_evictions_total",
                    "LoRA adapters the engine unloaded to stay within --max-loaded-loras, or dropped by a restart",
                    ["reason"])
LOAD_SECONDS = Histogram("inferbus_adapter_load_seconds", "Wall time of an adapter load, verification included",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
LOADED = Gauge("inferbus_adapters_loaded", "LoRA adapters loaded on this worker's engine")


def adapter_requests(adapters: Iterable[str | None]) -> dict[str, int]:
    """Requests per adapter ("" for the base model) among those a worker holds: which distinct
    adapters its engine's batch needs, for the router's batch-slot estimate."""
    counts: dict[str, int] = {}
    for adapter in adapters:
        counts[adapter or ""] = counts.get(adapter or "", 0) + 1
    return counts


def local_size(path: str) -> int | None:
    """Bytes of a local adapter directory (or file); None for anything else (an object store's path)."""
    try:
        root = Path(path)
        if root.is_file():
            return root.stat().st_size
        if not root.is_dir():
            return None
        return sum(entry.stat().st_size for entry in root.rglob("*") if entry.is_file()) or None
    except OSError:
        return None


class AdapterError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="adapter_unavailable", retryable=False, status=503)


class Adapters:
    def __init__(self, engine: EngineClient, lookup: Callable[[str], Awaitable[m.AdapterSpec | None]],
                 on_change: Callable[[], None] = lambda: None, on_progress: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.lookup = lookup  # adapter name → registered spec
        self.on_change = on_change  # the queue of loads changed: report it soon
        # The engine answered a load: its scheduler is alive. Requests waiting for their adapter's
        # turn produce no token meanwhile, which must not read as a hung GPU (gpu_death.py).
        self.on_progress = on_progress
        self.queue = LoadQueue(time.monotonic)  # loads queued and in flight, for the routers' cost
        self.loaded: dict[str, m.AdapterSpec | None] = {}  # engine name → spec (None: adopted from the engine's list)
        self.evictions = 0
        self._verified: set[str] = set()  # verified on this engine process
        # Loaded by the engine, now being verified: in the engine's list, not yet in `loaded`.
        self._verifying: set[str] = set()
        self._loading: dict[str, asyncio.Future[None]] = {}
        # One load at a time, in the queue's order (loads requests wait for before prefetches).
        self._turn = asyncio.Condition()
        self._engine_busy = False
        self._notifies: set[asyncio.Future[None]] = set()

    def names(self) -> list[str]:
        return sorted(self.loaded)

    async def ensure(self, engine_name: str, background: bool = False) -> None:
        """Make `engine_name` (`<name>@<digest prefix>`) usable on the engine, once. `background`: a
        prefetch, loaded only while no other load is queued (until a request asks for it too)."""
        if engine_name in self.loaded:
            return
        pending = self._loading.get(engine_name)
        if pending is None:
            self.queue.enqueue(engine_name, background=background)
            self.on_change()
            pending = self._loading[engine_name] = asyncio.ensure_future(self._load(engine_name))
            pending.add_done_callback(lambda _: self._loaded_or_failed(engine_name))
        elif not background:
            self.queue.enqueue(engine_name)  # a prefetch a request now waits for goes ahead of the others
            self._spawn_notify()
            self.on_change()
        await asyncio.shield(pending)

    def _loaded_or_failed(self, engine_name: str) -> None:
        self._loading.pop(engine_name, None)
        self._verifying.discard(engine_name)
        self.queue.finish(engine_name, measured=False)  # a failed load (a success finished already)
        self._spawn_notify()  # it may have been next in the queue
        self.on_change()

    def _spawn_notify(self) -> None:
        task = asyncio.ensure_future(self._notify())
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    async def _notify(self) -> None:
        async with self._turn:
            self._turn.notify_all()

    async def _take_turn(self, engine_name: str) -> None:
        async with self._turn:
            await self._turn.wait_for(lambda: not self._engine_busy and self.queue.next_up() == engine_name)
            self._engine_busy = True
            self.queue.start(engine_name)

    async def _end_turn(self) -> None:
        async with self._turn:
            self._engine_busy = False
            self._turn.notify_all()

    def prefetches(self) -> int:
        """Prefetches queued or loading here."""
        return self.queue.prefetches()

    def pending_loads(self) -> dict[str, float]:
        """Adapters queued, loading or being verified → expected seconds until each is ready (for the
        load report; one being verified holds its place in the engine's memory already, which a
        router filling that memory must count)."""
        pending = self.queue.expected()
        for name in self._verifying:
            pending.setdefault(name, 0.0)
        return pending

    def one_load_s(self) -> float:
        """Expected seconds of one more load here (0: none measured yet, the router's default applies)."""
        return self.queue.mean_s or 0.0

    async def _load(self, engine_name: str) -> None:
        name = engine_name.rpartition("@")[0]
        registered = await self.lookup(name)
        found = registered.version_of(engine_name) if registered is not None else None
        if registered is None or found is None:
            LOADS.labels("unregistered").inc()
            raise AdapterError(f"adapter {engine_name} is not registered (or its version changed)")
        # The version the request names: the registered one, or the candidate of the adapter's canary.
        version, path = found
        spec = msgspec.structs.replace(registered, version=version, path=path, candidate_version=None,
                                       candidate_path=None)
        mismatch = release_check.adapter_problem(spec)
        if mismatch is not None:
            log.error("adapter_digest_mismatch", adapter=engine_name, path=spec.path, problem=mismatch)
            raise AdapterError(f"adapter {spec.name} refused: {mismatch}")
        size = await asyncio.to_thread(local_size, spec.path) if os.path.isabs(spec.path) else None
        if size:
            self.queue.set_size(engine_name, size)  # the estimate of its load now knows its size
        started = time.perf_counter()
        await self._take_turn(engine_name)  # one at a time: each answer's list of loaded adapters is then current
        prefetch = self.queue.current is not None and self.queue.current.background  # nobody waited for it
        try:
            if engine_name in self.loaded:
                return
            result = await self.engine.load_lora(engine_name, spec.path)
            listed = result.get("loaded_adapters")
            if not result.get("success", False) and engine_name not in (listed or {}):
                LOADS.labels("failed").inc()
                raise AdapterError(
                    f"engine could not load adapter {spec.name}: {result.get('error_message') or 'unknown error'}")
            if listed is not None:
                self._follow(listed, engine_name)
            self._verifying.add(engine_name)  # in the engine's memory from now on
            self.queue.finish(engine_name)  # the engine is free for the next load
            self.on_progress()
        finally:
            await self._end_turn()
        # Verified after its turn: the probe waits for a batch step, and the next load need not.
        try:
            problem = None if engine_name in self._verified else await self._verify(engine_name, result)
        finally:
            self._verifying.discard(engine_name)
        if problem is not None:
            await self.engine.unload_lora(engine_name)
            LOADS.labels("unverified").inc()
            log.error("adapter_verification_failed", adapter=engine_name, path=spec.path, problem=problem)
            raise AdapterError(f"adapter {spec.name} failed verification after loading: {problem}")
        self._verified.add(engine_name)
        self.loaded[engine_name] = spec
        self._set_gauge()
        seconds = time.perf_counter() - started
        LOADS.labels("loaded").inc()
        LOAD_SECONDS.observe(seconds)
        log.info("adapter_loaded", adapter=engine_name, path=spec.path, load_s=round(seconds, 4),
                 loaded=len(self.loaded), prefetch=prefetch)

    def _follow(self, listed: Iterable[str], loading: str | None = None) -> None:
        """Take the engine's list of loaded adapters as the truth: what it no longer lists was evicted."""
        present = set(listed)
        for name in [name for name in self.loaded if name not in present and name != loading]:
            del self.loaded[name]
            self.evictions += 1
            EVICTIONS.labels("engine_cap").inc()
            log.info("adapter_evicted", adapter=name, loaded=len(present))
        self._set_gauge()

    async def _verify(self, engine_name: str, result: dict) -> str | None:
        listed = result.get("loaded_adapters")
        if listed is not None and engine_name not in listed:
            return "the engine does not list it as loaded"
        try:
            await self.engine.probe(engine_name)
        except EngineError as error:
            return f"a one-token generation with it failed: {error}"
        return None

    async def resync(self, restarted: bool = False) -> None:
        """Re-read what the engine holds. After a restart (a new process) nothing it held before is
        verified any more; what it lists now (adapters it loads at start-up) is adopted."""
        if restarted:
            self._verified.clear()
        try:
            listed = await self.engine.loaded_adapters()
        except Exception as error:  # the next load answer or resync corrects the view
            log.warning("adapter_resync_failed", error=repr(error))
            if restarted:
                lost = len(self.loaded)
                self.loaded.clear()
                if lost:
                    EVICTIONS.labels("engine_restart").inc(lost)
                self._set_gauge()
            return
        if restarted:
            dropped = [name for name in self.loaded if name not in listed]
            for name in dropped:
                del self.loaded[name]
            if dropped:
                EVICTIONS.labels("engine_restart").inc(len(dropped))
                log.info("adapters_lost_by_restart", adapters=dropped)
        else:
            self._follow(listed)
        for name in listed:
            self.loaded.setdefault(name, None)
        self._set_gauge()

    def forget(self, engine_name: str) -> None:
        """The engine no longer has it (it said so): load it again on next use."""
        if self.loaded.pop(engine_name, 0) != 0:
            self._set_gauge()

    def forget_all(self) -> int:
        count = len(self.loaded)
        self.loaded.clear()
        self._verified.clear()
        self._set_gauge()
        return count

    async def unload(self, engine_name: str) -> None:
        if engine_name in self.loaded:
            del self.loaded[engine_name]
            self._set_gauge()
            await self.engine.unload_lora(engine_name)

    def _set_gauge(self) -> None:
        LOADED.set(len(self.loaded))
