"""Every message on the bus, as msgspec structs encoded in msgpack.

Versioning: each struct carries `v` (the schema version it was written with). Decoders ignore
fields they do not know, so a newer writer may add optional fields without breaking older
readers; a breaking change bumps `v` and readers branch on it. Fields are only ever added with
defaults, never renamed or retyped.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

SCHEMA_VERSION = 1

FinishReason = Literal["stop", "length", "abort", "error"]


class _Message(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    v: int = SCHEMA_VERSION


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class InferenceRequest(_Message, tag="request"):
    """Gateway → worker, on `request_subject`. One per attempt; `attempt` > 0 is a migration."""

    request_id: str
    tenant: str
    model: str
    prompt: str  # rendered the way the engine sees it (see inferbus.prompt)
    sampling: SamplingParams
    reply_to: str  # token subject of the gateway holding the client (events are batched per gateway)
    deadline: float  # unix seconds; past it the worker aborts
    created: float  # unix seconds when the gateway accepted the request
    kind: Literal["chat", "completion"] = "chat"
    adapter: str | None = None
    tier: str = "standard"
    priority: int = 0  # engine priority, larger is more important (SGLang's convention)
    attempt: int = 0
    # Migration: the text and token count already streamed to the client by earlier attempts.
    # The worker continues from prompt + resumed_text and reports client-visible totals.
    resumed_text: str = ""
    resumed_tokens: int = 0
    prompt_tokens: int | None = None  # known once an earlier attempt reported it
    user: str | None = None
    api_key_id: str = ""  # which of the tenant's keys sent it (usage is grouped by key)
    # Prompt tokens the router expects the chosen worker to have cached: the worker reports the
    # rest as prefill still to do, which is what the router weighs.
    expected_cached_tokens: int = 0
    batch_id: str | None = None  # set for lines of a batch (billed at the batch discount)

    def engine_rid(self) -> str:
        """Fixed-length engine request id: SGLang's abort matches rids by prefix."""
        return f"{self.request_id}-{self.attempt:02d}"


class Accepted(_Message, tag="accepted"):
    """Worker → gateway: the engine took the request; `worker_id` now owns it."""

    request_id: str
    attempt: int
    worker_id: str
    queue_wait: float  # seconds from gateway accept to engine submit


class TokenChunk(_Message, tag="chunk"):
    """Worker → gateway: text generated since the previous chunk (already a delta)."""

    request_id: str
    attempt: int
    seq: int
    text: str
    completion_tokens: int  # client-visible total so far, including resumed tokens
    prompt_tokens: int | None = None


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Final(_Message, tag="final"):
    """Worker → gateway: the last event of a request, with engine-reported usage."""

    request_id: str
    attempt: int
    seq: int
    text: str  # any text not yet sent
    finish_reason: FinishReason
    usage: Usage
    matched_stop: str | None = None
    worker_id: str = ""


class StreamError(_Message, tag="error"):
    """Worker → gateway: the request failed. `retryable` errors may be migrated by the gateway."""

    request_id: str
    attempt: int
    code: str
    message: str
    retryable: bool = False
    status: int = 500


class Handoff(_Message, tag="handoff"):
    """Worker → gateway: this worker is draining and gave the request up; continue elsewhere."""

    request_id: str
    attempt: int
    worker_id: str


StreamEvent = Union[Accepted, TokenChunk, Final, StreamError, Handoff]


class StreamBatch(_Message):
    """Worker → gateway on `token_subject(gateway)`: the events for that gateway's requests that
    became ready together (one engine step's tokens for many streams), in order per request."""

    events: list[StreamEvent]


class Cancel(_Message):
    request_id: str
    reason: Literal["client_disconnect", "deadline", "admin"] = "client_disconnect"


class UsageEvent(_Message):
    """Worker (or gateway, when no worker finished it) → billing, on the USAGE stream.

    Exactly one per client request: published with `Nats-Msg-Id = request_id`.
    """

    request_id: str
    tenant: str
    model: str
    status: Literal["completed", "cancelled", "failed"]
    usage: Usage
    started: float
    finished: float
    adapter: str | None = None
    tier: str = "standard"
    worker_id: str = ""
    attempts: int = 1
    finish_reason: str | None = None
    api_key_id: str = ""
    batch_id: str | None = None


class WorkerLoad(_Message):
    """Worker → router/autoscaler every ~250 ms on `metrics_subject`."""

    worker_id: str
    model: str
    ts: float
    seq: int
    running: int
    waiting: int
    in_flight: int  # what this worker has taken off the bus and not finished
    max_running: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    cache_hit_rate: float = 0.0
    draining: bool = False
    completed: int = 0  # requests finished since the worker started (a counter: rates come from deltas)
    queued_prefill_tokens: int = 0  # prompt tokens taken but not yet prefilled (the work a new request queues behind)
    adapters: list[str] = []  # LoRA adapters loaded on the engine now
    # Requests taken from this worker's own queue since it started (a counter): what routers placed
    # here minus this is what still waits in the queue, invisible to the engine's numbers.
    pulled_own: int = 0


class BlockStored(msgspec.Struct, kw_only=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    block_size: int = 16
    adapter: str | None = None


class CacheEvent(_Message):
    """Worker → router on `cache_subject`: prefix blocks stored or evicted, gap-detectable by seq."""

    worker_id: str
    seq: int
    ts: float
    stored: list[BlockStored] = []
    removed: list[int] = []
    cleared: bool = False


class Heartbeat(_Message):
    """Value of `workers.<worker_id>` in the `workers` KV bucket, refreshed every second."""

    worker_id: str
    model: str
    engine_url: str
    started: float
    ts: float
    state: Literal["starting", "ready", "draining"] = "ready"
    max_running: int = 0
    adapters: list[str] = []
    gpu: str = ""
    tp: int = 0
    block_size: int = 0  # the engine's cache page in tokens; the router hashes prompts with it
    max_adapters: int = 0  # LoRA adapters the engine can hold at once (0: no LoRA)


class PlacementRequest(_Message):
    """Gateway → router on `placement_subject(model)` (request/reply)."""

    request_id: str
    model: str
    prompt_tokens: int
    adapter: str | None = None
    tier: str = "standard"
    # `inferbus.tokens.prefix_hashes(prompt, block_size, adapter=adapter)`: the chained prefix-block
    # hashes the engines' caches report, so the router can count blocks a worker already holds.
    block_hashes: list[int] = []
    block_size: int = 0


class PlacementReply(_Message):
    target: str  # `subjects.ANY_TARGET` or `subjects.worker_target(...)`
    worker_id: str | None = None
    reason: str = ""
    cached_blocks: int = 0  # leading blocks the router expects the chosen worker to hold


class Placed(_Message):
    """Router → every router replica on `placed_subject(model)`: a placement just made, so that
    replicas count each other's placements (load and prefixes) before workers report them."""

    router_id: str
    worker_id: str
    model: str
    prefill_tokens: int  # prompt tokens the worker must compute (not expected to be cached)
    block_hashes: list[int] = []
    adapter: str | None = None


class AdapterSpec(_Message):
    """A registered LoRA adapter: value of `<name>` in the `adapters` KV bucket.

    `version` pins the weights by digest (`sha256:<64 hex>`); a moving tag such as `latest` is
    refused, so every worker that loads `name` loads the same bytes. Engines know the adapter as
    `engine_name` (`<name>@<first 12 hex of the digest>`), which also namespaces its cache blocks.
    """

    name: str  # what clients put in `model`
    base_model: str
    version: str
    path: str  # where the engine loads the weights from
    created: float
    owner: str | None = None  # a tenant's private adapter; None: any tenant allowed the name

    @property
    def engine_name(self) -> str:
        return f"{self.name}@{self.version.removeprefix('sha256:')[:12]}"


class ControlCommand(_Message):
    """Operator/autoscaler → worker on `control_subject`."""

    action: Literal["drain", "resume", "load_adapter", "unload_adapter", "resync_cache"]
    adapter: str | None = None
    adapter_path: str | None = None


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(StreamBatch)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


def decode_stream_batch(data: bytes) -> StreamBatch:
    return _batch_decoder.decode(data)
