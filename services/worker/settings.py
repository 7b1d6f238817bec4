from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

from inferbus.settings import env


@dataclass(frozen=True)
class WorkerSettings:
    nats_url: str = env("NATS_URL", "nats://127.0.0.1:4222", "NATS server (2.11+ with JetStream).")
    worker_id: str = env("INFERBUS_WORKER_ID", "", "Unique id of this worker, one per engine replica (default: the host name).")
    engine_url: str = env("INFERBUS_ENGINE_URL", "http://127.0.0.1:30000", "Base URL of the SGLang server (or simulated engine) this worker drives.")
    model: str = env("INFERBUS_MODEL", "meta-llama/Llama-3.3-70B-Instruct", "Model id this worker serves (must match the gateway's).")
    engine_kv_events: str = env("INFERBUS_ENGINE_KV_EVENTS", "", "ZMQ endpoint where the engine publishes KV-cache events (SGLang --kv-events-config), e.g. tcp://127.0.0.1:5557; empty: no prefix-cache reporting.")
    tiers: str = env("INFERBUS_WORKER_TIERS", "premium,standard", "Priority bands to pull, most important first.")
    max_running: int = env("INFERBUS_WORKER_MAX_RUNNING", 0, "Requests to hold at once; 0 = the engine's max_running_requests from /server_info.")
    heartbeat_interval_s: float = env("INFERBUS_HEARTBEAT_INTERVAL_S", 1.0, "How often the heartbeat is refreshed in the `workers` KV bucket.")
    heartbeat_ttl_s: float = env("INFERBUS_HEARTBEAT_TTL_S", 3.0, "A worker whose heartbeat is older than this is dead.")
    load_interval_s: float = env("INFERBUS_LOAD_INTERVAL_S", 0.25, "How often engine load is polled and published.")
    fetch_timeout_s: float = env("INFERBUS_FETCH_TIMEOUT_S", 1.0, "Long-poll time of one pull request when the queue is empty.")
    ack_wait_s: float = env("INFERBUS_ACK_WAIT_S", 15.0, "Redelivery delay for a request pulled by a worker that died before accepting it.")
    drain_timeout_s: float = env("INFERBUS_DRAIN_TIMEOUT_S", 30.0, "On SIGTERM, how long in-flight requests may run before they are handed back.")
    metrics_port: int = env("INFERBUS_METRICS_PORT", 9102, "Port of this worker's Prometheus /metrics (0 disables).")
    log_level: str = env("INFERBUS_LOG_LEVEL", "info", "Log level.")
    otel_exporter: str = env("INFERBUS_OTEL_EXPORTER", "none", "Span exporter: none, console or otlp.")

    def resolved(self) -> WorkerSettings:
        return self if self.worker_id else dataclasses.replace(self, worker_id=socket.gethostname())

    def tier_list(self) -> list[str]:
        return [t.strip() for t in self.tiers.split(",") if t.strip()]
