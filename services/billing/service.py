"""Billing service: consumes the usage ledger (the `USAGE` stream).

Today it reconciles every request's admission reservation with what the engine reported
(exactly once, by request id); rollups, the price book and usage exports build on the same
consumer pattern (issue 6).
"""

from __future__ import annotations

import asyncio
import signal

import redis.asyncio as aioredis
from prometheus_client import start_http_server

from inferbus import bus, logs
from services.gateway.admission import Admission

from .pricing import Prices
from .reconcile import UsageReconciler
from .settings import BillingSettings

log = logs.get(__name__)


async def serve(settings: BillingSettings) -> None:
    logs.configure("billing", settings.log_level)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    nc = await bus.connect(settings.nats_url, name="billing")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    redis = aioredis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    prices = Prices(settings.price_input_per_mtok, settings.price_output_per_mtok, settings.price_cached_input_per_mtok)
    reconciler = UsageReconciler(js, Admission(redis), prices)
    await reconciler.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("billing_ready")
    await stop.wait()
    await reconciler.stop()
    await nc.drain()
    await redis.aclose()
    log.info("billing_stopped")
