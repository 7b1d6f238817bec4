from __future__ import annotations

from dataclasses import dataclass

from inferbus.settings import env


@dataclass(frozen=True)
class RouterSettings:
    nats_url: str = env("NATS_URL", "nats://127.0.0.1:4222", "NATS server (2.11+ with JetStream).")
    heartbeat_ttl_s: float = env("INFERBUS_HEARTBEAT_TTL_S", 3.0, "Workers silent this long are dead (match the workers').")
    kv_ceiling: float = env("INFERBUS_ROUTER_KV_CEILING", 0.95, "Workers whose KV cache is fuller than this get no new work.")
    temperature: float = env("INFERBUS_ROUTER_TEMPERATURE", 0.05, "Softmax temperature over normalised load (spreads ties across gateways).")
    metrics_port: int = env("INFERBUS_METRICS_PORT", 9101, "Port of the router's Prometheus /metrics (0 disables).")
    log_level: str = env("INFERBUS_LOG_LEVEL", "info", "Log level.")
    otel_exporter: str = env("INFERBUS_OTEL_EXPORTER", "none", "Span exporter: none, console or otlp.")
