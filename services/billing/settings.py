from __future__ import annotations

from dataclasses import dataclass

from inferbus.runtime import settings as shared
from inferbus.runtime.settings import env


@dataclass(frozen=True)
class BillingSettings:
    nats_url: str = shared.nats_url()
    redis_url: str = shared.redis_url("quota state, rollups and the price book")
    price_input_per_mtok: float = shared.price_input_per_mtok(
        "Dollars per 1M uncached prompt tokens: seeds the price book's `*`/`*` entry once (then `inferbus prices "
        "set`).")
    price_cached_input_per_mtok: float = shared.price_cached_input_per_mtok(
        "Dollars per 1M cached prompt tokens (seeds the price book)."
    )
    price_output_per_mtok: float = shared.price_output_per_mtok(
        "Dollars per 1M completion tokens (seeds the price book)."
    )
    batch_discount: float = env(
        "INFERBUS_BATCH_DISCOUNT", 0.5, "Fraction off for requests of a batch, 0..1 (seeds the price book)."
    )
    rollup_batch: int = env(
        "INFERBUS_BILLING_BATCH",
        2000,
        "Usage events pulled per request by the rollup consumer (two requests in flight).",
    )
    linger_s: float = env(
        "INFERBUS_BILLING_LINGER_S", 0.05,
        "How long the rollup and the reconciler let usage events gather before taking a batch: at a low rate each "
        "event would otherwise cost its own pull, Redis round trips and ack; rollups and budget spend lag by up to "
        "this.")
    ack_wait_s: float = env(
        "INFERBUS_BILLING_ACK_WAIT_S", 30.0,
        "Usage events a billing replica pulled and did not acknowledge within this are delivered again (to any "
        "replica).")
    minute_retention_s: int = env(
        "INFERBUS_BILLING_MINUTE_RETENTION_S", 48 * 3600, "How long 1-minute usage buckets are kept."
    )
    rollup_retention_s: int = env(
        "INFERBUS_BILLING_ROLLUP_RETENTION_S", 400 * 86400, "How long hourly and daily usage buckets are kept."
    )
    dedup_ttl_s: int = env(
        "INFERBUS_BILLING_DEDUP_TTL_S", 8 * 86400,
        "How long a counted request id is remembered: a duplicate usage event arriving later than this would count "
        "again.")
    export_dir: str = env("INFERBUS_EXPORT_DIR", ".inferbus/exports",
                          "Directory of the monthly usage exports (<dir>/<YYYY-MM>/<tenant>.<format>); empty disables "
                          "them.")
    export_format: str = env("INFERBUS_EXPORT_FORMAT", "csv", "Format of the monthly exports: csv, jsonl or parquet.")
    export_bucket: str = env("INFERBUS_EXPORT_BUCKET", "1h", "Bucket width of the monthly exports' rows: 1h or 1d.")
    export_delay_s: int = env(
        "INFERBUS_EXPORT_DELAY_S", 1800,
        "Last month is exported this long after the month ends (requests still running at midnight finish first).")
    metrics_port: int = shared.metrics_port(9103, "the billing service's")
    log_level: str = shared.log_level()
