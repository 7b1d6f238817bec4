from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0)
_TPOT = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.25, 0.5)

REQUESTS = Counter("inferbus_requests_total", "Finished HTTP requests", ["endpoint", "status"])
TTFT = Histogram("inferbus_ttft_seconds", "Time to first token, gateway accept to first byte of text", buckets=_LATENCY)
TPOT = Histogram("inferbus_tpot_seconds", "Mean time per output token after the first, per request", buckets=_TPOT)
E2E = Histogram("inferbus_e2e_seconds", "Gateway accept to last token", buckets=_LATENCY)
QUEUE_WAIT = Histogram("inferbus_queue_wait_seconds", "Gateway accept to engine submit", buckets=_LATENCY)
TOKENS = Counter("inferbus_tokens_total", "Tokens served", ["kind"])
INFLIGHT = Gauge("inferbus_inflight_requests", "Requests in flight in this gateway")
MIGRATIONS = Counter("inferbus_migrations_total", "Requests continued on another worker")
ERRORS = Counter("inferbus_errors_total", "Requests that ended in an error", ["type"])
PLACEMENTS = Counter("inferbus_placements_total", "Where requests were queued: a worker's own queue or the shared one", ["target"])
FAIR_QUEUE = Gauge("inferbus_fair_queue_requests", "Requests waiting in this gateway's fair queue for their turn")
SHED = Counter("inferbus_shed_total", "Requests refused with 503 `overloaded` before queueing, by band", ["band"])
DEATH_VERDICTS = Counter("inferbus_worker_death_verdicts_total",
                         "Lapsed heartbeats checked with a liveness probe: `dead` (its streams migrate) or `alive`", ["verdict"])
NOT_STARTED = Counter("inferbus_not_started_total", "Requests a worker did not start in time, moved to the shared queue")
