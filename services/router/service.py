"""Router service: the placement authority.

It answers gateways' placement requests from a view it builds out of bus events: worker
heartbeats (the registry, in the `workers` KV bucket), load reports every ~250 ms, cache events
(prefix blocks stored and evicted, per worker in sequence) and the placements every router replica
makes (`Placed`). Replicas share placement requests through a queue group and see every event, so
they agree. A replica that starts, or notices a gap in a worker's cache events, asks that worker
for a snapshot of its cache. When a worker dies, the router forgets it and moves the requests
still queued for it to the shared queue (`recovery`).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import Coroutine
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from inferbus.bus import connection as bus
from inferbus.bus.replies import Replies
from inferbus.bus.security_events import answerable
from inferbus.releases.slo_gate import SloConfig
from inferbus.runtime import logs, tracing
from inferbus.runtime.records import decode_or_none
from inferbus.stores import adapters as adapter_registry
from inferbus.timing import kv_link
from proto import messages as m
from proto import subjects

from . import recovery
from .adapter_prefetch import Prefetcher, PrefetchWorker
from .canary import CanaryService
from .config import RoutingConfig
from .pairing import PairConfig
from .placement import make_placer
from .settings import RouterSettings

log = logs.get(__name__)

PLACEMENTS = Counter("inferbus_router_placements_total", "Placement decisions", ["reason"])
CACHED_BLOCKS = Counter(
    "inferbus_router_expected_cached_blocks_total", "Prefix blocks placements expected to find cached"
)
WORKERS = Gauge("inferbus_router_workers", "Workers the router considers alive")
INDEX_BLOCKS = Gauge("inferbus_router_index_blocks", "Prefix blocks in the router's index, all workers")
RESYNCS = Counter("inferbus_router_cache_resyncs_total", "Cache snapshots asked of workers (start, gaps)")
RECOVERED = Counter("inferbus_router_recovered_requests_total", "Queued requests moved off dead workers")
PLACE_SECONDS = Histogram(
    "inferbus_router_place_seconds", "Time to decide one placement",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
)

ROUTER_QUEUE = "routers"
RESYNC_MIN_INTERVAL_S = 2.0
PRELOAD_REPEAT_S = 5.0  # a worker told to load an adapter is not told again this soon
PREFETCH_INTERVAL_S = 1.0  # how often the router looks for adapters to prefetch
REGISTERED_REFRESH_S = 10.0  # how often it re-reads the registered adapters
PREFETCHES = Counter(
    "inferbus_router_adapter_prefetches_total", "LoRA adapter prefetches into host memory asked of workers"
)

_placement_decoder = msgspec.msgpack.Decoder(m.PlacementRequest)
_load_decoder = msgspec.msgpack.Decoder(m.WorkerLoad)
_heartbeat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)
_cache_decoder = msgspec.msgpack.Decoder(m.CacheEvent)
_placed_decoder = msgspec.msgpack.Decoder(m.Placed)


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.router_id = settings.router_id or f"router-{secrets.token_hex(4)}"
        config = RoutingConfig(
            block_size=settings.block_size,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
            kv_ceiling=settings.kv_ceiling,
            temperature=settings.temperature,
            prefill_tokens_per_s=settings.prefill_tokens_per_s,
            miss_weight=settings.miss_weight,
            decode_weight_s=settings.decode_weight_s,
            adapter_load_s=settings.adapter_load_s,
            adapter_slot_hold_s=settings.adapter_slot_hold_s,
            adapter_spread=settings.adapter_spread,
            time_scale=settings.time_scale,
            share_weight_s=settings.share_weight_s,
            share_limit=settings.share_limit,
            share_window_s=settings.share_window_s,
            share_granularity=settings.share_granularity,
            index_blocks_per_worker=settings.index_blocks_per_worker,
            index_ttl_s=settings.index_ttl_s,
        )
        try:
            link = kv_link(settings.kv_link)
        except ValueError as error:
            raise SystemExit(f"INFERBUS_ROUTER_KV_LINK: {error}") from None
        self.placer = make_placer(settings.policy, time.monotonic, config, pair_config=PairConfig(link=link))
        self.registry = self.placer.registry
        self._resync_asked: dict[str, float] = {}
        self._preloads: dict[tuple[str, str], float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._recovering: set[str] = set()
        self._registry_loaded = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.prefetcher = Prefetcher(time.monotonic)

    async def start(self) -> None:
        s = self.settings
        # no_echo: a replica does not receive its own `Placed` messages back (it counted them already).
        self.nc = await bus.connect(s.nats_url, name=self.router_id, no_echo=True)
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.kv = await bus.workers_bucket(self.js, s.heartbeat_ttl_s)
        self.replies = Replies(self.nc)
        await self.replies.start()
        self.watcher = await self.kv.watchall()
        # The view's subscriptions take turns with the others: a backlog of events (after the
        # process was starved of CPU) must not hold placement questions until it is worked off.
        await self.nc.subscribe(subjects.metrics_wildcard(), cb=bus.taking_turns(self._on_load))
        await self.nc.subscribe(
            subjects.cache_wildcard(), cb=bus.taking_turns(self._on_cache), pending_msgs_limit=1_000_000
        )
        await self.nc.subscribe(
            subjects.placed_wildcard(), cb=bus.taking_turns(self._on_placed), pending_msgs_limit=1_000_000
        )
        # Placement requests last: by then the view is being built.
        await self.nc.subscribe(subjects.placement_wildcard(), queue=ROUTER_QUEUE, cb=self._on_place)
        self.canary = CanaryService(self.nc, self.router_id, SloConfig(
            min_samples=s.canary_min_samples, latency_tolerance=s.canary_latency_tolerance,
            error_tolerance=s.canary_error_tolerance, cancel_tolerance=s.canary_cancel_tolerance,
            false_rollback=s.canary_false_rollback), tick_s=s.canary_tick_s)
        await self.canary.start()
        self._tasks = [
            asyncio.create_task(self._watch(), name="watch-workers"),
            asyncio.create_task(self._expire(), name="expire"),
            asyncio.create_task(self._scan_for_orphans(), name="recovery-scan"),
        ]
        if s.adapter_prefetch:
            self._adapter_kv = await adapter_registry.bucket(self.js)
            self._tasks.append(asyncio.create_task(self._prefetch_adapters(), name="adapter-prefetch"))
        log.info("router_ready", router_id=self.router_id, policy=self.placer.name)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.watcher.stop()
        await self.canary.stop()
        await self.replies.stop()
        await self.nc.drain()

    # ---- placement ---------------------------------------------------------------------------

    async def _on_place(self, msg: Msg) -> None:
        started = time.perf_counter()
        try:
            request = _placement_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if not answerable(msg):
            return  # a reply subject no caller owns: answering would publish there with our rights
        reply = self.placer.place(request, record=False)
        await msg.respond(m.encode(reply))
        PLACE_SECONDS.observe(time.perf_counter() - started)
        PLACEMENTS.labels(reply.reason).inc()
        if reply.worker_id is not None:
            # One event-loop pass first: the client's flusher sends the reply, then the view is
            # updated (before the next placement request is read).
            await asyncio.sleep(0)
            self._after_placement(request, reply)

    def _after_placement(self, request: m.PlacementRequest, reply: m.PlacementReply) -> None:
        """Count the placement in this replica's view, tell the other replicas, preload adapters."""
        assert reply.worker_id is not None
        self.placer.record(request, reply)
        CACHED_BLOCKS.inc(reply.cached_blocks)
        if request.adapter:
            self._spawn(self._preload(reply.worker_id, request.adapter))
            if reply.prefill_worker_id:  # a pair: both engines run the adapter
                self._spawn(self._preload(reply.prefill_worker_id, request.adapter))
            warm = self.placer.warm_target(request)
            if warm is not None:  # a hot adapter's next home: loaded before traffic moves there
                slots = self.registry.adapter_slots
                homes = slots.homes.get(request.adapter)
                log.info("adapter_home_warmed", adapter=request.adapter, worker=warm,
                         homes=len(homes.workers) if homes else 0,
                         wanted=slots.wanted_homes(request.adapter, len(self.registry.workers)))
                self._spawn(self._preload(warm, request.adapter))
        for worker_id, prefill_tokens, hashes, _ in self.placer.placements(request, reply):  # both halves of a pair
            placed = m.Placed(
                router_id=self.router_id, worker_id=worker_id, model=request.model, adapter=request.adapter,
                prefill_tokens=prefill_tokens, block_hashes=hashes, prompt_tokens=request.prompt_tokens,
            )
            self._spawn(self.nc.publish(subjects.placed_subject(request.model), m.encode(placed)))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _preload(self, worker_id: str, adapter: str) -> None:
        """Start loading an adapter while the request is still on its way to the worker."""
        view = self.registry.workers.get(worker_id)
        if view is None or adapter in view.adapters:
            return
        now = time.monotonic()
        if now - self._preloads.get((worker_id, adapter), -1e9) < PRELOAD_REPEAT_S:
            return
        self._preloads[(worker_id, adapter)] = now
        if len(self._preloads) > 10_000:
            self._preloads = {key: at for key, at in self._preloads.items() if now - at < PRELOAD_REPEAT_S}
        command = m.ControlCommand(action="load_adapter", adapter=adapter)
        await self.nc.publish(subjects.control_subject(worker_id), m.encode(command))

    async def _prefetch_adapters(self) -> None:
        """Ask workers whose engines cap their host memory to load registered adapters nobody
        holds yet, in the background (adapter_prefetch.py)."""
        registered: dict[str, list[str]] = {}  # base model → engine names
        read_at = -REGISTERED_REFRESH_S
        while True:
            await asyncio.sleep(PREFETCH_INTERVAL_S)
            try:
                if not any(view.max_loaded_adapters for view in self.registry.workers.values()):
                    continue
                if time.monotonic() - read_at >= REGISTERED_REFRESH_S:
                    read_at = time.monotonic()
                    registered = {}
                    for spec in await adapter_registry.list_all(self._adapter_kv):
                        registered.setdefault(spec.base_model, []).append(spec.engine_name)
                slots = self.registry.adapter_slots
                for model, names in registered.items():
                    workers = [PrefetchWorker(view.worker_id, view.max_loaded_adapters, view.adapters,
                                              tuple(slots.loading.get(view.worker_id, {})), view.adapter_prefetches)
                               for view in self.registry.eligible(model).values() if self.registry.alive(view)]
                    for worker_id, adapter in self.prefetcher.plan(names, workers, slots.share):
                        PREFETCHES.inc()
                        log.info("adapter_prefetch_asked", adapter=adapter, worker=worker_id)
                        command = m.ControlCommand(action="load_adapter", adapter=adapter, background=True)
                        await self.nc.publish(subjects.control_subject(worker_id), m.encode(command))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the next pass tries again
                log.warning("adapter_prefetch_failed", error=repr(error))

    async def _on_placed(self, msg: Msg) -> None:
        try:
            placed = _placed_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if placed.router_id != self.router_id:
            self.registry.on_placed(placed)

    # ---- the view ----------------------------------------------------------------------------

    async def _on_load(self, msg: Msg) -> None:
        try:
            load = _load_decoder.decode(msg.data)
            self.registry.on_load(load)
            self.canary.on_load(load)
        except msgspec.DecodeError:
            pass

    async def _on_cache(self, msg: Msg) -> None:
        try:
            event = _cache_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if not self.registry.on_cache(event):
            await self._ask_resync(event.worker_id)
        elif event.cleared and event.worker_id in self.registry.workers:
            log.info("cache_snapshot_applied", worker_id=event.worker_id, stored=len(event.stored))

    async def _ask_resync(self, worker_id: str) -> None:
        now = time.monotonic()
        if now - self._resync_asked.get(worker_id, -1e9) < RESYNC_MIN_INTERVAL_S:
            return
        self._resync_asked[worker_id] = now
        RESYNCS.inc()
        command = m.ControlCommand(action="resync_cache")
        await self.nc.publish(subjects.control_subject(worker_id), m.encode(command))

    async def _watch(self) -> None:
        await bus.follow(self.watcher, self._on_heartbeat, self._on_heartbeat_deleted, self._registry_loaded.set)

    async def _on_heartbeat(self, entry: KeyValue.Entry) -> None:
        beat = decode_or_none(_heartbeat_decoder, entry.value or b"", store="workers", key=entry.key)
        if beat is None:
            return
        known = beat.worker_id in self.registry.workers
        self.registry.on_heartbeat(beat)
        if not known:
            log.info("worker_joined", worker_id=beat.worker_id, model=beat.model)
            if not self.registry.cache_compatible(self.registry.workers[beat.worker_id]):
                log.warning("block_size_mismatch", worker_id=beat.worker_id, worker_block_size=beat.block_size,
                            router_block_size=self.settings.block_size,
                            consequence="its cache events are ignored: affinity only from placements")
            await self._ask_resync(beat.worker_id)
        WORKERS.set(len(self.registry.workers))

    def _on_heartbeat_deleted(self, key: str) -> None:
        for worker_id in [w for w in self.registry.workers if subjects.worker_key(w) == key]:
            self._worker_gone(worker_id, "heartbeat deleted")

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.settings.heartbeat_ttl_s / 4))
            for worker_id in self.registry.expire():
                self._worker_gone(worker_id, "heartbeat expired", already_forgotten=True)
            WORKERS.set(len(self.registry.workers))
            INDEX_BLOCKS.set(len(self.registry.index))

    def _worker_gone(self, worker_id: str, why: str, already_forgotten: bool = False) -> None:
        if not already_forgotten:
            self.registry.on_worker_gone(worker_id)
        self._resync_asked.pop(worker_id, None)
        log.warning("worker_gone", worker_id=worker_id, why=why)
        WORKERS.set(len(self.registry.workers))
        task = asyncio.create_task(self._recover_orphans(), name="recovery")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    # ---- recovery ----------------------------------------------------------------------------

    async def _scan_for_orphans(self) -> None:
        await self._registry_loaded.wait()
        # Give live workers one heartbeat period to show up before judging their queues.
        await asyncio.sleep(self.settings.heartbeat_ttl_s)
        while True:
            await self._recover_orphans()
            await asyncio.sleep(self.settings.recovery_scan_s)

    def _alive_tokens(self) -> set[str]:
        """The subject tokens of the workers the registry holds alive."""
        return {subjects.token(worker_id) for worker_id in self.registry.workers}

    def _alive(self, token: str) -> bool:
        return token in self._alive_tokens()

    async def _recover_orphans(self) -> None:
        if not self._registry_loaded.is_set():
            return
        try:
            consumers = await recovery.worker_consumers(self.js)
        except Exception as error:
            log.warning("recovery_scan_failed", error=repr(error))
            return
        alive = self._alive_tokens()
        young = datetime.now(timezone.utc) - timedelta(seconds=2 * self.settings.heartbeat_ttl_s)
        for worker, info in consumers:
            if worker in alive or info.name in self._recovering:
                continue
            created = info.created if isinstance(info.created, datetime) else None
            if created is not None and created.tzinfo is not None and created > young:
                continue  # a worker still starting: its first heartbeat may not be out yet
            self._recovering.add(info.name)
            try:
                result = await recovery.recover(
                    self.js, self.replies, info, give_up_after_s=float(info.config.ack_wait or 30) + 5,
                    revived=partial(self._alive, worker),
                )
            except Exception as error:  # before it moved anything: the next scan tries again
                log.warning("recovery_failed", consumer=info.name, error=repr(error))
                continue
            finally:
                self._recovering.discard(info.name)
            RECOVERED.inc(result.moved)
            # Not drained: the rest waits for the next scan.
            log.warning("recovered_queue", worker=worker, consumer=info.name, moved=result.moved,
                        drained=result.drained, error=result.error or None)


async def serve(settings: RouterSettings) -> None:
    logs.configure("router", settings.log_level)
    tracing.configure("router", settings.otel_exporter)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    router = Router(settings)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await router.stop()
    log.info("router_stopped")
