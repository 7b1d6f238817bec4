from __future__ import annotations

from dataclasses import dataclass

from inferbus.settings import env


@dataclass(frozen=True)
class BillingSettings:
    nats_url: str = env("NATS_URL", "nats://127.0.0.1:4222", "NATS server (2.11+ with JetStream).")
    redis_url: str = env("REDIS_URL", "redis://127.0.0.1:6379/0", "Redis holding tenants' quota state.")
    price_input_per_mtok: float = env("INFERBUS_PRICE_INPUT_PER_MTOK", 0.60, "Dollars per 1M uncached prompt tokens (budgets).")
    price_cached_input_per_mtok: float = env("INFERBUS_PRICE_CACHED_INPUT_PER_MTOK", 0.15, "Dollars per 1M cached prompt tokens.")
    price_output_per_mtok: float = env("INFERBUS_PRICE_OUTPUT_PER_MTOK", 0.90, "Dollars per 1M completion tokens.")
    metrics_port: int = env("INFERBUS_METRICS_PORT", 9103, "Port of the billing service's Prometheus /metrics (0 disables).")
    log_level: str = env("INFERBUS_LOG_LEVEL", "info", "Log level.")
