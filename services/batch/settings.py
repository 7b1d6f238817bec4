from __future__ import annotations

import socket
from dataclasses import dataclass

from inferbus.runtime import settings as shared
from inferbus.runtime.settings import env

from .feed import FeedConfig


@dataclass(frozen=True)
class BatchSettings:
    nats_url: str = shared.nats_url()
    redis_url: str = shared.redis_url("the tenants (who may use which model)")
    model: str = shared.model("Base model served (must match the gateway's).")
    model_dir: str = shared.model_dir(
        "Directory of the served model as its engines load it (tokenizer.json, tokenizer_config.json with the chat "
        "template): prompts are rendered and tokenized with the model's own files. Required; `inferbus up` builds "
        "a small one (python -m inferbus.tokens.modeldir DIR).",
    )
    files_dir: str = shared.files_dir(
        "Where the file store keeps uploaded and generated files (shared with the gateway)."
    )
    service_id: str = env(
        "INFERBUS_BATCH_SERVICE_ID", "main",
        "Id of this batch service; workers send a line's `Accepted` to `inferbus.tok.batch-<id>`. Keep it stable "
        "across restarts so lines published before a restart still report their worker. Run one batch service.",
    )
    max_model_len: int = shared.max_model_len(
        "Context window: prompt plus max_tokens must fit (as the gateway's; 0: the served model's)."
    )
    default_max_tokens: int = shared.default_max_tokens("max_tokens of a line that gives none (as the gateway's).")
    max_lines: int = env("INFERBUS_BATCH_MAX_LINES", 50_000, "Most requests in one input file.")
    max_bytes: int = env("INFERBUS_BATCH_MAX_BYTES", 200 * 1024 * 1024, "Largest input file in bytes.")
    max_errors: int = env("INFERBUS_BATCH_MAX_ERRORS", 100, "Validation stops after this many errors.")
    max_line_bytes: int = shared.max_body_bytes("Largest input line in bytes (as the gateway's largest request body).")
    max_json_depth: int = shared.max_json_depth(
        "Deepest nesting of arrays and objects in an input line's body (as the gateway's)."
    )
    max_in_flight: int = env(
        "INFERBUS_BATCH_MAX_IN_FLIGHT",
        4096,
        "Most lines published and unfinished at once, whatever the feed policy allows.",
    )
    line_lease_s: float = env(
        "INFERBUS_BATCH_LINE_LEASE_S",
        900.0,
        "A line with no result this long after it was published or last accepted is published again.",
    )
    cancel_grace_s: float = env(
        "INFERBUS_BATCH_CANCEL_GRACE_S",
        5.0,
        "After cancelling a batch's in-flight lines (cancel or expiry), how long to wait for their results before "
        "finalizing.",
    )
    flush_interval_s: float = env(
        "INFERBUS_BATCH_FLUSH_INTERVAL_S", 1.0, "How often request_counts and usage are written to the batch records."
    )
    feed_interval_s: float = env(
        "INFERBUS_BATCH_FEED_INTERVAL_S", 0.1, "How often the feed loop asks the feed policy for room."
    )
    window_scale: float = env(
        "INFERBUS_BATCH_WINDOW_SCALE", 1.0,
        "For tests and demos only: multiplies the completion window (24 h) of batches validated from now on; "
        "0.0001 makes it about 9 s.",
    )
    worker_gone_grace_s: float = env(
        "INFERBUS_BATCH_WORKER_GONE_GRACE_S",
        5.0,
        "A worker whose heartbeat ended and did not come back within this long has its lines published again.",
    )
    heartbeat_ttl_s: float = shared.heartbeat_ttl_s("Workers silent this long are dead (match the workers').")
    ttft_slo_s: float = env("INFERBUS_BATCH_TTFT_SLO_S", 0.8, "Interactive p90 TTFT the feed protects (seconds).")
    tpot_slo_s: float = env("INFERBUS_BATCH_TPOT_SLO_S", 0.04, "Interactive p90 TPOT the feed protects (seconds).")
    queue_wait_budget_s: float = env(
        "INFERBUS_BATCH_QUEUE_WAIT_BUDGET_S", 0.5, "Interactive p90 queue wait the feed protects (seconds)."
    )
    pressure_fraction: float = env(
        "INFERBUS_BATCH_PRESSURE_FRACTION",
        1.0,
        "Feeding pauses once an interactive p90 passes this share of its SLO (the cap on the relative budgets).",
    )
    latency_tolerance: float = env(
        "INFERBUS_BATCH_LATENCY_TOLERANCE",
        0.09,
        "Feeding pauses once interactive p90 TTFT or TPOT exceeds the p90 learned while batch was light by this share.",
    )
    baseline_wait_s: float = env(
        "INFERBUS_BATCH_BASELINE_WAIT_S",
        15.0,
        "After the first worker report, seconds spent learning the interactive-alone p90 before feeding any batch "
        "line.",
    )
    max_slowdown: float = env(
        "INFERBUS_BATCH_MAX_SLOWDOWN",
        0.06,
        "Engine step-time increase batch lines may cause (sets the lines per worker).",
    )
    reserve_slots: int = env(
        "INFERBUS_BATCH_RESERVE_SLOTS", 4, "Slots per worker batch never takes (room for interactive arrivals)."
    )
    step_base_s: float = env(
        "INFERBUS_BATCH_STEP_BASE_S",
        0.0186,
        "Engine step time with one sequence, for workers whose engine's GPU and TP the timing model does not know "
        "(others are capped by theirs); default H100 TP2.",
    )
    step_per_seq_s: float = env(
        "INFERBUS_BATCH_STEP_PER_SEQ_S", 0.000165, "Engine step time added per running sequence, for the same workers."
    )
    metrics_port: int = shared.metrics_port(9105, "the batch service's")
    log_level: str = shared.log_level()

    def __post_init__(self) -> None:
        if self.window_scale <= 0:
            raise SystemExit(f"INFERBUS_BATCH_WINDOW_SCALE must be > 0, got {self.window_scale}")
        for name, value in (("INFERBUS_BATCH_LINE_LEASE_S", self.line_lease_s),
                            ("INFERBUS_BATCH_FLUSH_INTERVAL_S", self.flush_interval_s),
                            ("INFERBUS_BATCH_FEED_INTERVAL_S", self.feed_interval_s)):
            if value <= 0:
                raise SystemExit(f"{name} must be > 0, got {value}")
        if self.max_lines < 1 or self.max_bytes < 1 or self.max_in_flight < 1:
            raise SystemExit("INFERBUS_BATCH_MAX_LINES, _MAX_BYTES and _MAX_IN_FLIGHT must be >= 1")
        try:
            self.feed_config()
        except ValueError as error:
            raise SystemExit(f"invalid batch feed settings: {error}") from None

    def expires_at(self, created_at: int, expires_at: int) -> int:
        """A batch's deadline once validated: the completion window as created, scaled by
        `window_scale` (tests and demos; 1 in production)."""
        if self.window_scale == 1.0:
            return expires_at
        return created_at + max(1, round(max(1, expires_at - created_at) * self.window_scale))

    def resolved_id(self) -> str:
        return self.service_id or socket.gethostname()

    def feed_config(self) -> FeedConfig:
        return FeedConfig(
            ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s, queue_wait_budget_s=self.queue_wait_budget_s,
            pressure_fraction=self.pressure_fraction, latency_tolerance=self.latency_tolerance,
            baseline_wait_s=self.baseline_wait_s, stale_after_s=self.heartbeat_ttl_s,
            step_base_s=self.step_base_s, step_per_seq_s=self.step_per_seq_s, max_slowdown=self.max_slowdown,
            reserve_slots=self.reserve_slots,
        )
