"""Router service: answers placement requests and keeps the worker registry from bus events."""

from __future__ import annotations

import asyncio
import signal
import time

import msgspec
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, start_http_server

from inferbus import bus, logs, tracing
from proto import messages as m
from proto import subjects

from .policy import PlacementPolicy
from .settings import RouterSettings

log = logs.get(__name__)

PLACEMENTS = Counter("inferbus_router_placements_total", "Placement decisions", ["reason"])
WORKERS = Gauge("inferbus_router_workers", "Workers the router considers alive")

_placement_decoder = msgspec.msgpack.Decoder(m.PlacementRequest)
_load_decoder = msgspec.msgpack.Decoder(m.WorkerLoad)
_heartbeat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)
ROUTER_QUEUE = "routers"


async def serve(settings: RouterSettings) -> None:
    logs.configure("router", settings.log_level)
    tracing.configure("router", settings.otel_exporter)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    policy = PlacementPolicy(clock=time.monotonic, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                             kv_ceiling=settings.kv_ceiling, temperature=settings.temperature)
    nc = await bus.connect(settings.nats_url, name="router")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    kv = await bus.workers_bucket(js, settings.heartbeat_ttl_s)

    async def on_place(msg: Msg) -> None:
        try:
            reply = policy.place(_placement_decoder.decode(msg.data))
        except msgspec.DecodeError:
            return
        PLACEMENTS.labels(reply.reason).inc()
        await msg.respond(m.encode(reply))

    async def on_load(msg: Msg) -> None:
        try:
            policy.on_load(_load_decoder.decode(msg.data))
        except msgspec.DecodeError:
            pass

    # Every router replica sees every event and builds the same view; placements are shared
    # among replicas by a queue group.
    await nc.subscribe(subjects.placement_wildcard(), queue=ROUTER_QUEUE, cb=on_place)
    await nc.subscribe(subjects.metrics_wildcard(), cb=on_load)
    watcher = await kv.watchall()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch() -> None:
        while True:
            entry = await watcher.updates(timeout=None)  # type: ignore[arg-type]
            if entry is None:
                continue
            if entry.operation in ("DEL", "PURGE"):
                for worker_id in [w for w in policy.workers if subjects.worker_key(w) == entry.key]:
                    policy.on_worker_gone(worker_id)
                    log.warning("worker_gone", worker_id=worker_id)
                continue
            try:
                policy.on_heartbeat(_heartbeat_decoder.decode(entry.value))
            except msgspec.DecodeError:
                continue
            WORKERS.set(len(policy.workers))

    async def expire() -> None:
        while True:
            await asyncio.sleep(0.5)
            for worker_id in policy.expire():
                log.warning("worker_expired", worker_id=worker_id)
            WORKERS.set(len(policy.workers))

    tasks = [asyncio.create_task(watch()), asyncio.create_task(expire())]
    log.info("router_ready")
    await stop.wait()
    for task in tasks:
        task.cancel()
    await watcher.stop()
    await nc.drain()
    log.info("router_stopped")
