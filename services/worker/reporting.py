"""What a worker tells the fleet about itself: its heartbeat (the registry's `workers` bucket; the
liveness thread keeps it fresh) and its load report every `load_interval_s` (routers, gateways,
the batch service and the autoscaler read it), with the counters and latency histograms it keeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from .adapters import ADAPTER_RESYNC_S, adapter_requests
from .attempt import Attempt
from .http import HTTPError
from .metrics import KV_USAGE

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.kv import KeyValue

    from proto.bands import Band

    from .adapters import Adapters
    from .cache_events import CacheRelay
    from .engine import EngineClient, EngineLoad
    from .engine_health import EngineHealth
    from .liveness import LivenessThread
    from .release_check import AdapterOutcomes, ReleaseCounters
    from .settings import WorkerSettings

log = logs.get(__name__)

LOAD_REPORT_MIN_GAP_S = 0.02  # at most ~50 load reports a second, however busy


@dataclass
class ServingStats:
    """Counters since the worker started, and interactive latency histograms (cumulative; one
    count per bucket of LATENCY_BUCKETS_S / TPOT_BUCKETS_S, see `WorkerLoad`)."""

    completed: int = 0  # requests finished (the gateways' overload policy takes rates from deltas)
    completed_batch: int = 0
    batch_in_flight: int = 0
    pulled_own: int = 0  # requests taken from this worker's own queue (routers compare with their placements)
    ttft_hist: list[int] = field(default_factory=list)
    queue_wait_hist: list[int] = field(default_factory=list)
    tpot_hist: list[int] = field(default_factory=list)

    def observe_ttft(self, seconds: float) -> None:
        m.observe(self.ttft_hist, m.LATENCY_BUCKETS_S, seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        m.observe(self.queue_wait_hist, m.LATENCY_BUCKETS_S, seconds)

    def observe_tpot(self, entry: Attempt, tokens: int, now: float) -> None:
        """The mean time per output token after the first, of a request that made `tokens`."""
        tpot = tpot_of(entry, tokens, now)
        if tpot is not None:
            m.observe(self.tpot_hist, m.TPOT_BUCKETS_S, tpot)


def tpot_of(entry: Attempt, tokens: int, now: float) -> float | None:
    return (now - entry.first_token_at) / (tokens - 1) if entry.first_token_at and tokens > 1 else None


def engine_gpu(info: dict[str, Any]) -> tuple[str, int]:
    """The engine's GPU type and tensor-parallel width from its /server_info ("" / 0: unknown)."""
    return str(info.get("gpu", "")), int(info.get("tp_size", 0) or 0)


def engine_context_length(info: dict[str, Any]) -> int:
    """The context window the engine enforces, from its /server_info (0: unknown). SGLang reports
    `context_length` only when --context-length was given; its scheduler's `max_req_input_len` is
    min(context length, KV pool) - 6 either way."""
    flag = info.get("context_length")
    if isinstance(flag, int) and not isinstance(flag, bool) and flag > 0:
        return flag
    longest = info.get("max_req_input_len")
    if isinstance(longest, int) and not isinstance(longest, bool) and longest > 0:
        return longest + 6
    return 0


def engine_max_adapters(info: dict[str, Any]) -> int:
    """Distinct adapters per batch, the base model counting as one (SGLang --max-loras-per-batch)."""
    if not info.get("enable_lora"):
        return 0
    return int(info.get("max_loras_per_batch") or 0)


def engine_max_loaded_adapters(info: dict[str, Any]) -> int:
    """Adapters the engine keeps loaded before it evicts (SGLang --max-loaded-loras; 0: no limit)."""
    return int(info.get("max_loaded_loras") or 0) if info.get("enable_lora") else 0


class BatchView(Protocol):
    """Of a worker's batch lines, what its load report reads and the check it runs each report."""

    def waiting(self) -> int: ...
    async def check(self, load: EngineLoad) -> None: ...


class ServingView(Protocol):
    @property
    def capacity(self) -> int: ...
    @property
    def batch(self) -> BatchView: ...


class PrefillView(Protocol):
    """Of a prefill worker's side, the halves it holds."""

    @property
    def halves(self) -> Sized: ...
    def batch_halves(self) -> int: ...
    def queued_prefill_tokens(self) -> int: ...


class Reported(Protocol):
    """What the load reporter may read of its worker, and what it may tell it (the engine looks
    down, or the worker should verify itself)."""

    kv_capacity_tokens: int  # the engine's KV cache, from the last load poll

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def engine_info(self) -> dict[str, Any]: ...
    @property
    def nc(self) -> Client: ...
    @property
    def kv(self) -> KeyValue: ...
    @property
    def liveness(self) -> LivenessThread: ...
    @property
    def health(self) -> EngineHealth: ...
    @property
    def adapters(self) -> Adapters: ...
    @property
    def cache_relay(self) -> CacheRelay | None: ...
    @property
    def release_counts(self) -> ReleaseCounters: ...
    @property
    def adapter_outcomes(self) -> AdapterOutcomes: ...
    @property
    def stats(self) -> ServingStats: ...
    @property
    def running(self) -> dict[str, Attempt]: ...
    @property
    def serving(self) -> ServingView | None: ...
    @property
    def prefill(self) -> PrefillView | None: ...
    @property
    def decode(self) -> object | None: ...
    @property
    def phase(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def started(self) -> float: ...
    @property
    def draining(self) -> bool: ...
    @property
    def leaving(self) -> bool: ...
    @property
    def load_changed(self) -> asyncio.Event: ...

    def bands(self) -> list[Band]: ...
    def pulls_held(self) -> bool: ...
    def engine_down(self, why: str) -> None: ...
    def verify_soon(self, why: str) -> None: ...


class LoadReporter:
    def __init__(self, worker: Reported) -> None:
        self.worker = worker
        self._seq = 0
        self._adapter_resync_at = 0.0  # monotonic time of the next re-read of the engine's adapters

    # ---- heartbeat -------------------------------------------------------------------------

    def beat(self) -> m.Heartbeat:
        worker = self.worker
        s, serving = worker.settings, worker.serving
        gpu, tp = engine_gpu(worker.engine_info)
        state: Literal["starting", "ready", "draining"] = ("draining" if worker.draining or worker.pulls_held()
                 # "starting" while the engine is down: alive, but not to be given requests.
                 else "ready" if worker.health.up else "starting")
        return m.Heartbeat(
            worker_id=s.worker_id, model=s.model, engine_url=s.engine_url, started=worker.started, ts=time.time(),
            state=state, max_running=serving.capacity if serving is not None else 0, gpu=gpu, tp=tp,
            # The relay rebuilds the engine's pages into platform blocks: those are what the router indexes.
            block_size=s.block_size if worker.cache_relay is not None else 0,
            max_adapters=engine_max_adapters(worker.engine_info), adapters=worker.adapters.names(),
            max_loaded_adapters=engine_max_loaded_adapters(worker.engine_info),
            release=worker.release_counts.release_id, zone=s.zone, role=worker.role,
            bands=s.band_list(), kv_capacity_tokens=worker.kv_capacity_tokens,
            context_length=engine_context_length(worker.engine_info),
        )

    async def heartbeat(self) -> None:
        worker = self.worker
        beat = self.beat()
        worker.liveness.set_beat(beat)  # its thread keeps it fresh, whatever this loop is doing
        await worker.kv.put(subjects.worker_key(worker.settings.worker_id), m.encode(beat))

    async def publish_heartbeat(self) -> None:
        """Put the heartbeat now, if this worker is in the registry (serving); failures are logged."""
        if self.worker.phase != "serving" or self.worker.serving is None:
            return
        try:
            await self.heartbeat()
        except Exception as error:
            log.warning("heartbeat_failed", error=repr(error))

    async def heartbeat_loop(self) -> None:
        # The liveness thread puts the heartbeat; this loop keeps its copy current (state, adapters).
        while True:
            await asyncio.sleep(self.worker.settings.heartbeat_interval_s)
            self.worker.liveness.set_beat(self.beat())

    # ---- load ------------------------------------------------------------------------------

    async def load_loop(self) -> None:
        worker = self.worker
        while True:
            # Every interval, and soon after a prefill finishes: the router weighs queued prefill,
            # and a report that still counts finished work sends the next request elsewhere.
            try:
                await asyncio.wait_for(worker.load_changed.wait(), timeout=worker.settings.load_interval_s)
                await asyncio.sleep(LOAD_REPORT_MIN_GAP_S)
            except asyncio.TimeoutError:
                pass
            worker.load_changed.clear()
            serving = worker.serving
            if worker.phase != "serving" or serving is None:
                await self.publish_idle()
                continue
            if not worker.health.up:
                continue  # the engine watch probes it, with backoff
            try:
                load = await worker.engine.loads()
            except Exception as error:
                if worker.health.up:
                    log.warning("engine_load_failed", error=repr(error))
                if isinstance(error, HTTPError):
                    worker.engine_down(f"load poll failed: {error!r}")
                worker.verify_soon("engine_load_failed")
                continue
            try:
                await serving.batch.check(load)
            except Exception as error:  # the load report must go out regardless
                log.warning("preemption_check_failed", error=repr(error))
            if engine_max_loaded_adapters(worker.engine_info) and time.monotonic() >= self._adapter_resync_at:
                self._adapter_resync_at = time.monotonic() + ADAPTER_RESYNC_S  # the engine evicts by itself
                await worker.adapters.resync()
            self._seq += 1
            KV_USAGE.set(load.used_tokens / load.capacity_tokens if load.capacity_tokens else 0.0)
            worker.kv_capacity_tokens = load.capacity_tokens
            halves = len(worker.prefill.halves) if worker.prefill is not None else 0
            snapshot = m.WorkerLoad(
                worker_id=worker.settings.worker_id, model=worker.settings.model, ts=time.time(), seq=self._seq,
                running=load.running, waiting=load.waiting, in_flight=len(worker.running) + halves,
                max_running=serving.capacity, kv_used_tokens=load.used_tokens,
                kv_capacity_tokens=load.capacity_tokens, cache_hit_rate=load.cache_hit_rate, draining=worker.draining,
                completed=worker.stats.completed, queued_prefill_tokens=self._queued_prefill_tokens(),
                adapters=worker.adapters.names(), pulled_own=worker.stats.pulled_own,
                **self._autoscaling_fields(serving.batch.waiting()),
                adapter_requests=adapter_requests(entry.request.adapter for entry in worker.running.values()),
                adapter_loads=worker.adapters.pending_loads(), adapter_load_s=round(worker.adapters.one_load_s(), 4),
                adapter_prefetches=worker.adapters.prefetches(), role=worker.role, bands=worker.bands(),
            )
            await worker.nc.publish(subjects.metrics_subject(worker.settings.worker_id), m.encode(snapshot))

    async def publish_idle(self) -> None:
        """A starting or warm worker offers no slots (max_running 0): gateways count none of it and
        routers, which know only registered workers, ignore it; the autoscaler counts it."""
        worker = self.worker
        self._seq += 1
        snapshot = m.WorkerLoad(
            worker_id=worker.settings.worker_id, model=worker.settings.model, ts=time.time(), seq=self._seq,
            running=0, waiting=0, in_flight=0, max_running=0, kv_used_tokens=0, kv_capacity_tokens=0,
            draining=worker.leaving, completed=worker.stats.completed, pulled_own=worker.stats.pulled_own,
            role=worker.role,
            **self._autoscaling_fields(worker.serving.batch.waiting() if worker.serving is not None else 0),
        )
        try:
            await worker.nc.publish(subjects.metrics_subject(worker.settings.worker_id), m.encode(snapshot))
        except Exception as error:
            log.warning("load_publish_failed", error=repr(error))

    def _queued_prefill_tokens(self) -> int:
        worker = self.worker
        if worker.prefill is not None:  # the prompts decode workers sent here
            return worker.prefill.queued_prefill_tokens()
        if worker.decode is not None:
            return 0  # its requests' prompts are computed by prefill workers
        return sum(
            max(0, (entry.request.prompt_tokens or 0) + entry.request.resumed_tokens
                - entry.request.expected_cached_tokens)
            for entry in worker.running.values() if not entry.prefilled
        )

    def _autoscaling_fields(self, batch_waiting: int) -> dict[str, Any]:
        worker, stats = self.worker, self.worker.stats
        gpu, tp = engine_gpu(worker.engine_info)
        # A prefill worker's batch lines are the halves of them decode workers sent it.
        batch_halves = worker.prefill.batch_halves() if worker.prefill is not None else 0
        return dict(
            phase=worker.phase, batch_in_flight=stats.batch_in_flight + batch_halves,
            completed_batch=stats.completed_batch,
            batch_waiting=batch_waiting, ttft_hist=list(stats.ttft_hist), queue_wait_hist=list(stats.queue_wait_hist),
            tpot_fine_hist=list(stats.tpot_hist), gpu=gpu, tp=tp, **worker.release_counts.load_fields(),
            adapter_outcomes=worker.adapter_outcomes.load_field(),
        )
