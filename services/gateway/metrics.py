from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from proto import bands

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0)
_TPOT = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.25, 0.5)

# Latency histograms are labelled so each model's (and band's) SLO can be read on its own. Every
# label is bounded: `model` is the catalog's resolved model, and only models with workers get this
# far; `adapter` is whether a LoRA adapter served the request ("lora") or not ("base"), never its
# name (adapters are per tenant, unbounded); `band` is one of the interactive bands, or
# "other". Series per histogram ≤ served models × 2 × (bands + 1).
LATENCY_LABELS = ["model", "adapter", "band"]


def latency_labels(model: str, adapter: str | None, band: str) -> tuple[str, str, str]:
    return model, "base" if adapter is None else "lora", band if band in bands.INTERACTIVE else "other"


REQUESTS = Counter("inferbus_requests_total", "Finished HTTP requests", ["endpoint", "status"])
TTFT = Histogram("inferbus_ttft_seconds", "Time to first token, gateway accept to first byte of text", LATENCY_LABELS,
                 buckets=_LATENCY)
TPOT = Histogram("inferbus_tpot_seconds", "Mean time per output token after the first, per request", LATENCY_LABELS,
                 buckets=_TPOT)
E2E = Histogram("inferbus_e2e_seconds", "Gateway accept to last token", LATENCY_LABELS, buckets=_LATENCY)
QUEUE_WAIT = Histogram("inferbus_queue_wait_seconds", "Gateway accept to engine submit", LATENCY_LABELS,
                       buckets=_LATENCY)
TOKENS = Counter("inferbus_tokens_total", "Tokens served", ["kind"])
INFLIGHT = Gauge("inferbus_inflight_requests", "Requests in flight in this gateway")
MIGRATIONS = Counter("inferbus_migrations_total", "Requests continued on another worker")
ERRORS = Counter("inferbus_errors_total", "Requests that ended in an error", ["type"])
RESPONSES = Counter("inferbus_responses_total", "Responses-API requests (also counted as chat requests), by HTTP "
                    "status and response status (`completed`, `incomplete`, `failed`; empty for an error status)",
                    ["status", "response_status"])
RESPONSES_NOT_STORED = Counter("inferbus_responses_not_stored_total", "Responses asked to be stored that were not",
                               ["reason"])
PLACEMENTS = Counter(
    "inferbus_placements_total", "Where requests were queued: a worker's own queue or the shared one", ["target"]
)
FAIR_QUEUE = Gauge("inferbus_fair_queue_requests", "Requests waiting in this gateway's fair queue for their turn")
SHED = Counter("inferbus_shed_total", "Requests refused with 503 `overloaded` before queueing, by band", ["band"])
DEATH_VERDICTS = Counter(
    "inferbus_worker_death_verdicts_total",
    "Lapsed heartbeats checked with a liveness probe: `dead` (its streams migrate) or `alive`",
    ["verdict"],
)
RESENDS = Counter(
    "inferbus_stream_resends_total",
    "Streams whose worker was asked to send missed events again (a gap in their chunks, or silence), by its answer: "
    "running, finished, unknown (the request continues on another worker) or no_answer", ["answer"],
)
NOT_STARTED = Counter(
    "inferbus_not_started_total", "Requests a worker did not start in time, moved to the shared queue"
)
PLACEMENT_SECONDS = Histogram(
    "inferbus_placement_seconds", "From asking the router where to queue a request to its answer, by outcome: "
    "`answered` while the request waited for it, `late` (after the request went to the shared queue: the router is "
    "slow; see INFERBUS_PLACEMENT_PATIENCE_MS), `unanswered` (no router, or none within 30 s)",
    ["outcome"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
)
PLACEMENTS_OVER_BUDGET = Counter("inferbus_placements_over_budget_total",
                                 "Placements on a worker whose own queue would hold the request past its band's "
                                 "budget, queued on the shared queue instead")
PLACEMENTS_PINNED = Counter("inferbus_placements_pinned_total",
                            "Requests pinned to a release (eval runs) the router did not place in time, queued "
                            "by the gateway on a worker of that release instead of the shared queue")
