from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from inferbus.openai.schemas import MAX_MESSAGES, MAX_TOOLS
from inferbus.runtime import settings as shared
from inferbus.runtime.node_zone import read_zone
from inferbus.runtime.settings import env
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE


def _default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class GatewaySettings:
    host: str = env("INFERBUS_GATEWAY_HOST", "127.0.0.1", "Address the HTTP API listens on.")
    port: int = env("INFERBUS_GATEWAY_PORT", 8080, "Port of the HTTP API.")
    keep_alive_s: int = env(
        "INFERBUS_GATEWAY_KEEP_ALIVE_S", 75,
        "How long an idle client connection stays open. Longer than clients' and load balancers' own idle timeouts "
        "(httpx, and so the openai SDK, 5 s; AWS ALB 60 s), so the client, not the gateway, closes an idle "
        "connection: when the gateway closes it first, a request sent on it at that moment fails with a connection "
        "error.",
    )
    nats_url: str = shared.nats_url()
    redis_url: str = shared.redis_url("API keys (and quotas)")
    redis_max_connections: int = env(
        "INFERBUS_REDIS_MAX_CONNECTIONS", 64, "Redis connections per gateway; more requests wait for one."
    )
    model: str = shared.model("Model id served and listed by /v1/models.")
    model_dir: str = shared.model_dir(
        "Directory of the served model as its engines load it (tokenizer.json, tokenizer_config.json with the chat "
        "template): prompts are rendered and tokenized with the model's own files. Required; `inferbus up` builds "
        "a small one (python -m inferbus.tokens.modeldir DIR).",
    )
    zone: str = shared.zone("this gateway")
    zone_file: str = shared.zone_file("this gateway's")
    gateway_id: str = env("INFERBUS_GATEWAY_ID", "", "Unique id of this replica (default: host-pid-random).")
    max_body_bytes: int = shared.max_body_bytes(
        "Largest JSON request body (and batch input line) accepted (413 above)."
    )
    max_json_depth: int = shared.max_json_depth(
        "Deepest nesting of arrays and objects in a JSON request body or batch input line (400 above)."
    )
    max_tools: int = env(
        "INFERBUS_MAX_TOOLS",
        MAX_TOOLS,
        "Most `tools` in one chat request (400 above), checked before any tool's schema is.",
    )
    max_messages: int = env(
        "INFERBUS_MAX_MESSAGES",
        MAX_MESSAGES,
        "Most `messages` in one chat request (400 above), checked before any is read.",
    )
    max_model_len: int = shared.max_model_len(
        "Context window: prompt plus max_tokens must fit. 0: the smallest window the model's ready engines report in "
        "their /server_info (an engine started with --context-length), else the served model's, read from its "
        "config.json as SGLang reads it (max_position_embeddings and the like).",
    )
    default_max_tokens: int = shared.default_max_tokens("max_tokens when the request gives none.")
    request_timeout_s: float = env("INFERBUS_REQUEST_TIMEOUT_S", 600.0, "Deadline of one request, queue wait included.")
    max_attempts: int = env(
        "INFERBUS_MAX_ATTEMPTS", 3, "Attempts per request across worker failures (1 = no migration)."
    )
    heartbeat_ttl_s: float = shared.heartbeat_ttl_s(
        "Workers silent this long are asked whether they live (match the workers')."
    )
    liveness_timeout_s: float = shared.liveness_timeout_s(
        "How long a worker whose heartbeat lapsed has to answer the liveness probe before it is declared dead and its "
        "streams migrate."
    )
    stream_silence_s: float = env(
        "INFERBUS_STREAM_SILENCE_S", 2.0,
        "A started stream that receives nothing from its worker for this long asks the worker to send again any events "
        "the gateway missed (core NATS drops messages in flight when a node dies: a stream's lost last events would "
        "otherwise hold its client until the client gives up); a worker that no longer has them continues the request "
        "elsewhere. Keep it below the workers' INFERBUS_WORKER_REPLAY_KEEP_S. 0: never ask.",
    )
    accept_timeout_s: float = env(
        "INFERBUS_ACCEPT_TIMEOUT_S",
        5.0,
        "A request queued on one worker that has not started it within this long moves to the shared queue.",
    )
    state_dir: str = shared.state_dir("the usage outbox: usage events waiting for JetStream's acknowledgement")
    placement_timeout_ms: float = env(
        "INFERBUS_PLACEMENT_TIMEOUT_MS", 50.0,
        "Ask the router where to place each request (prefix, adapter and load affinity), waiting this long; "
        "without an answer the request goes to the shared queue, which any worker serves. 0 = never ask.",
    )
    placement_patience_ms: float = shared.placement_patience_ms(
        "How long a placement waits for a router that is answering (one answered, in time or late, in the last 5 s), "
        "instead of INFERBUS_PLACEMENT_TIMEOUT_MS: a slow router (its CPU limited, its host busy) still answers from "
        "its whole view, where the shared queue would place by chance. A router that stops answering is waited for "
        "INFERBUS_PLACEMENT_TIMEOUT_MS again.",
    )
    block_size: int = shared.block_size(
        DEFAULT_BLOCK_SIZE,
        "placement hashes are cut into blocks of this size; must match the router's and the workers' (engines may use "
        "any page size).",
    )
    key_cache_ttl_s: float = env("INFERBUS_KEY_CACHE_TTL_S", 10.0, "How long an API key lookup is cached in-process.")
    admin_key: str = env(
        "INFERBUS_ADMIN_KEY", "",
        "Bearer key of the admin API (/admin/v1: tenants and API keys). Empty = the admin API is off (404).",
    )
    quota_on_redis_error: str = env(
        "INFERBUS_QUOTA_ON_REDIS_ERROR", "closed",
        "When Redis is unreachable: `closed` refuses requests (503, retry-after) so no tenant exceeds its quota; "
        "`open` serves them unmetered.",
    )
    lease_ttl_s: float = env(
        "INFERBUS_LEASE_TTL_S",
        900.0,
        "A concurrency lease whose request never reported back frees itself after this long.",
    )
    queue_budget_premium_s: float = env(
        "INFERBUS_QUEUE_BUDGET_PREMIUM_S",
        10.0,
        "Expected queue wait above which premium requests get 503 (see docs/overload-policy.md).",
    )
    queue_budget_standard_s: float = env(
        "INFERBUS_QUEUE_BUDGET_STANDARD_S", 3.0, "Expected queue wait above which standard requests get 503."
    )
    start_lag_window_s: float = env(
        "INFERBUS_START_LAG_WINDOW_S",
        10.0,
        "How far back the overload policy's measured start lag reaches (times to first token of the requests this "
        "gateway admitted, with the ages of those still waiting); 0 turns it and the head-of-line wait off and leaves "
        "the queue model alone (see docs/overload-policy.md).",
    )
    dispatch_window_per_worker: int = env(
        "INFERBUS_DISPATCH_WINDOW_PER_WORKER", 2,
        "This gateway's requests allowed to wait in the shared queue per live worker; more wait in its fair queue.",
    )
    price_input_per_mtok: float = shared.price_input_per_mtok("Dollars per 1M uncached prompt tokens (budgets).")
    price_cached_input_per_mtok: float = shared.price_cached_input_per_mtok("Dollars per 1M cached prompt tokens.")
    price_output_per_mtok: float = shared.price_output_per_mtok("Dollars per 1M completion tokens.")
    files_dir: str = shared.files_dir(
        "Directory of /v1/files uploads and batch output files (`<dir>/<tenant>/<file id>`); the batch service "
        "must see the same directory (a shared volume when they run on different hosts).",
    )
    max_file_bytes: int = env(
        "INFERBUS_MAX_FILE_BYTES", 200 * 1024 * 1024, "Largest /v1/files upload accepted (413 above)."
    )
    responses_retention_s: float = env(
        "INFERBUS_RESPONSES_RETENTION_S", 30 * 24 * 3600.0,
        "How long a stored /v1/responses response (and its conversation) is kept; OpenAI keeps them 30 days.",
    )
    responses_max_bytes: int = env(
        "INFERBUS_RESPONSES_MAX_BYTES", 768 * 1024,
        "Largest stored response, conversation included (JSON bytes); a longer conversation is a 400. "
        "Must stay under the NATS server's max_payload (1 MiB by default).",
    )
    tool_call_parser: str = env(
        "INFERBUS_TOOL_CALL_PARSER", "llama3",
        "How the served model writes tool calls, to read them into `tool_calls`: `llama3` (JSON "
        "`{\"name\", \"parameters\"}`), `hermes` (also `qwen25`: `<tool_call>{...}</tool_call>`), `mistral` "
        "(`[TOOL_CALLS][...]`, 9-character call ids), `pythonic` (Llama-4: `[f(x=1)]`), `deepseekv3`/`deepseekv31` "
        "(a `<｜tool▁calls▁begin｜>` block) or `gpt-oss` (harmony messages to `functions.NAME`; the engine is asked "
        "to keep special tokens in its text when the model may call); SGLang's --tool-call-parser names. `auto`: "
        "the family whose call markers the model's chat template writes (llama3 when it shows none).",
    )
    internal_api: bool = env(
        "INFERBUS_INTERNAL_API", True,
        "Serve /v1/chat/completions and /v1/completions to internal producers over NATS request/reply "
        "(subjects inferbus.api.v1.*, tenant API key in the Authorization header; see docs/api.md).",
    )
    access_log: bool = env(
        "INFERBUS_ACCESS_LOG", True, "One JSON log line per generation request (tenant, status, tokens, latency)."
    )
    adapter_metrics_top: int = env(
        "INFERBUS_ADAPTER_METRICS_TOP",
        20,
        "LoRA adapters named in the per-adapter metrics (the busiest, re-ranked every 30 s); the rest are counted as "
        "`other`.",
    )
    console: bool = env(
        "INFERBUS_CONSOLE", True,
        "Serve the web console at /console: tenants sign in with an API key (usage and cost, keys, limits, batches, "
        "adapters), operators with INFERBUS_ADMIN_KEY (SLOs, fleet, tenants and prices, releases, autoscaler); see "
        "docs/console.md.",
    )
    console_idle_s: float = env(
        "INFERBUS_CONSOLE_IDLE_S", 3600.0, "A console session ends after this long without a page view."
    )
    console_max_age_s: float = env(
        "INFERBUS_CONSOLE_MAX_AGE_S", 43200.0, "A console session ends this long after sign-in, in use or not."
    )
    slo_ttft_p90_s: float = env(
        "INFERBUS_SLO_TTFT_P90_S", 0.8, "The p90 time-to-first-token budget the console judges the SLO by (seconds)."
    )
    slo_tpot_p90_s: float = env(
        "INFERBUS_SLO_TPOT_P90_S", 0.04, "The p90 time-per-output-token budget the console judges the SLO by (seconds)."
    )
    slo_error_share: float = env(
        "INFERBUS_SLO_ERROR_SHARE", 0.001, "The share of 5xx answers the console judges the SLO by."
    )
    slo_record_interval_s: float = env(
        "INFERBUS_SLO_RECORD_INTERVAL_S", 10.0,
        "How often this gateway adds what its SLO metrics gained (TTFT, TPOT, requests by status, shed) to the "
        "per-minute totals in Redis that the console's SLO page reads.",
    )
    log_level: str = shared.log_level()
    otel_exporter: str = shared.otel_exporter()

    def __post_init__(self) -> None:
        from inferbus.openai.tools import PARSERS

        if self.tool_call_parser not in PARSERS and self.tool_call_parser != "auto":
            raise SystemExit(f"invalid value for INFERBUS_TOOL_CALL_PARSER: {self.tool_call_parser!r} "
                             f"(auto or one of {', '.join(sorted(PARSERS))})")

    def resolved_gateway_id(self) -> str:
        return self.gateway_id or _default_gateway_id()

    def resolved_zone(self) -> str:
        """INFERBUS_ZONE, else the zone in INFERBUS_ZONE_FILE (Kubernetes: the node's zone label)."""
        return read_zone(self.zone, self.zone_file)
