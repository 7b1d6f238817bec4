"""The worker's Prometheus metrics (one process, one worker: module-level, as prometheus_client wants)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("inferbus_worker_requests_total", "Requests finished by this worker", ["status"])
RUNNING = Gauge("inferbus_worker_running_requests", "Requests this worker holds")
FREE_SLOTS = Gauge("inferbus_worker_free_slots", "Slots free for new requests")
KV_USAGE = Gauge("inferbus_worker_kv_usage_ratio", "Engine KV cache use (0-1)")
ENGINE_ERRORS = Counter("inferbus_worker_engine_errors_total", "Engine failures seen by this worker")
PREEMPTIONS = Counter("inferbus_worker_preemptions_total", "Batch lines preempted for waiting interactive work")
PAUSES = Counter(
    "inferbus_worker_pauses_total",
    "Times this worker's event loop resumed after a pause (then it re-verified its engine and consumers)",
)
ABANDONED = Counter(
    "inferbus_worker_abandoned_attempts_total",
    "Attempts this worker gave up or was told to give up, billed to the platform",
    ["reason"],
)
BATCH_REQUEUED = Counter(
    "inferbus_worker_batch_requeued_total", "Batch lines put back on the batch queue to resume elsewhere", ["reason"]
)
QUEUE_WAIT = Histogram(
    "inferbus_worker_queue_wait_seconds",
    "Gateway accept to engine submit",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
STREAM_FRAMES = Counter("inferbus_worker_stream_frames_total", "Stream frames (bus messages) sent to gateways")
RESENDS = Counter(
    "inferbus_worker_stream_resends_total",
    "Gateways' requests to send a stream's events again (they saw a gap or heard nothing), by the attempt's state: "
    "running, finished or unknown (not kept: the gateway continues the request elsewhere)", ["state"],
)
STREAM_EVENTS = Counter(
    "inferbus_worker_stream_events_total", "Stream events sent to gateways, after merging a stream's waiting tokens"
)
PREFILL_TRIES = Counter(
    "inferbus_worker_prefill_tries_total",
    "Decode workers: prefill halves sent to prefill workers, by how each try ended (ok, prefill_failed, "
    "refused_full, refused_draining, no_answer)", ["outcome"],
)
PREFILL_HALVES = Counter(
    "inferbus_worker_prefill_halves_total",
    "Prefill workers: prefill halves taken from decode workers, by how they ended (ok, failed, aborted, preempted: a "
    "batch half that gave way to an interactive one, refused)",
    ["outcome"],
)
PINNED_ELSEWHERE = Counter(
    "inferbus_worker_pinned_elsewhere_total",
    "Requests pinned to another release that reached this worker (from the shared queue), handed back to their "
    "gateway unrun",
)
DUPLICATES = Counter(
    "inferbus_worker_duplicate_deliveries_total",
    "Deliveries of an attempt already run by this or another worker (a redelivery, a second copy), acked and "
    "absorbed: by where the first one runs (here, elsewhere)", ["holder"],
)
