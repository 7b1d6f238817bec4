"""Billing service: consumes the usage ledger (the `USAGE` stream).

Three jobs, each safe to run in several replicas:
- `RollupConsumer` (durable consumer `usage-rollup`): every usage event, exactly once, into
  per-tenant usage and cost rollups in Redis, priced by the versioned price book;
- `UsageReconciler` (durable consumer `admission-reconciler`): each request's admission
  reservation replaced by its actual cost, exactly once, for budgets;
- `MonthlyExporter`: last month's usage per tenant into `INFERBUS_EXPORT_DIR`, once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import start_http_server

from inferbus.bus import connection as bus
from inferbus.runtime import logs, redis_conn
from inferbus.runtime.extras import MissingExtra, require
from inferbus.stores.admission import Admission
from inferbus.stores.billing import PriceStore, UsageStore
from inferbus.stores.pricing import Prices

from .attribution import Holders
from .export import MonthlyExporter
from .reconcile import UsageReconciler
from .rollup import RollupConsumer
from .settings import BillingSettings

log = logs.get(__name__)


def default_prices(settings: BillingSettings) -> Prices:
    return Prices(settings.price_input_per_mtok, settings.price_output_per_mtok, settings.price_cached_input_per_mtok,
                  settings.batch_discount)


def usage_store(redis: aioredis.Redis, settings: BillingSettings) -> UsageStore:
    return UsageStore(redis, minute_retention_s=settings.minute_retention_s,
                      rollup_retention_s=settings.rollup_retention_s, dedup_ttl_s=settings.dedup_ttl_s)


async def serve(settings: BillingSettings) -> None:
    logs.configure("billing", settings.log_level)
    defaults = default_prices(settings)  # refuses bad prices before anything starts
    if settings.export_format not in ("csv", "jsonl", "parquet") or settings.export_bucket not in ("1h", "1d"):
        raise SystemExit("INFERBUS_EXPORT_FORMAT must be csv, jsonl or parquet; INFERBUS_EXPORT_BUCKET 1h or 1d")
    if settings.export_format == "parquet":
        try:
            require("pyarrow", "parquet", "INFERBUS_EXPORT_FORMAT=parquet")
        except MissingExtra as error:
            raise SystemExit(str(error)) from error  # at start, not at the first month's export
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    nc = await bus.connect(settings.nats_url, name="billing")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    redis = redis_conn.async_client(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
    prices = PriceStore(redis, default=defaults)
    store = usage_store(redis, settings)

    async def prepare() -> None:
        await prices.seed(defaults)
        await store.state.publish_config(settings.minute_retention_s)

    await bus.retry_forever("billing_redis_setup", prepare)
    rollup = RollupConsumer(nc, settings.nats_url, store, prices, batch=settings.rollup_batch,
                            ack_wait_s=settings.ack_wait_s, linger_s=settings.linger_s, holders=Holders(js))
    await rollup.start()
    admission = Admission(redis)
    reconciler = UsageReconciler(js, admission, prices, linger_s=settings.linger_s, holders=Holders(js))
    await reconciler.start()
    exporter = None
    if settings.export_dir:
        exporter = MonthlyExporter(store, Path(settings.export_dir), fmt=settings.export_format,
                                   width=settings.export_bucket, delay_s=settings.export_delay_s,
                                   caught_up=lambda: rollup.caught_up(slack=2 * settings.rollup_batch),
                                   clock=time.time)
        await exporter.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("billing_ready")
    await stop.wait()
    if exporter is not None:
        await exporter.stop()
    await rollup.stop()
    await reconciler.stop()
    await nc.drain()
    await admission.aclose()
    await redis.aclose()
    log.info("billing_stopped")
