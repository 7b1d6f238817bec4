"""Every message on the bus, as msgspec structs encoded in msgpack.

Versioning: each struct carries `v` (the schema version it was written with). Decoders ignore
fields they do not know, so a newer writer may add optional fields without breaking older
readers; a breaking change bumps `v` and readers branch on it. Fields are added with defaults
and never retyped. A field renamed keeps its old name as a field that readers take in place of
the new one and writers never fill, for as long as a message written under the old name may still
be in a stream at an upgrade: `tier`, the name of `band` until the vocabulary was unified.
"""

from __future__ import annotations

import bisect
import secrets
from collections.abc import Sequence
from typing import Literal, Union

import msgspec

from proto.bands import Band

SCHEMA_VERSION = 1

FinishReason = Literal["stop", "length", "abort", "error"]

# What a worker's engine does in prefill/decode disaggregation (SGLang's `--disaggregation-mode`:
# `null` is "aggregated" here): an aggregated engine prefills and decodes its own requests; a
# prefill engine computes prompts and sends their KV to a decode engine, which generates.
# A plain str on the wire (readers keep an unknown future role apart rather than failing).
Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[str, ...] = ("aggregated", "prefill", "decode")

# Upper bounds (seconds) of the latency histograms in WorkerLoad. Part of the schema: changing
# them needs new fields, because readers pair counts with these bounds.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
)
# 1 ms apart from 5 to 60 ms: the batch feed holds interactive TPOT within ~9% of its level
# without batch and under the 40 ms SLO, which 5 ms buckets (20% wide at 25 ms) cannot resolve.
# (WorkerLoad.tpot_fine_hist; the 5 ms buckets were tpot_hist.)
TPOT_BUCKETS_S: tuple[float, ...] = tuple(i / 1000 for i in range(5, 61)) + (
    0.07, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0,
)


def observe(hist: list[int], bounds: tuple[float, ...], value: float) -> None:
    """Count `value` into a cumulative histogram kept as WorkerLoad sends it: one count per upper
    bound in `bounds` (a value equal to a bound falls in that bucket) plus one for +inf."""
    if len(hist) != len(bounds) + 1:
        hist[:] = [0] * (len(bounds) + 1)
    hist[bisect.bisect_left(bounds, value)] += 1


def hist_percentile(counts: Sequence[int], bounds: Sequence[float], q: float) -> float | None:
    """The q-quantile of a histogram kept as `observe` keeps it (counts per bucket, one more than
    `bounds` for +inf), interpolated linearly inside its bucket. None for an empty histogram."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            low = bounds[i - 1] if i > 0 else 0.0
            if i >= len(bounds):
                return low  # beyond the last bound: say at least that much
            return low + (bounds[i] - low) * (rank - seen) / count
        seen += count
    return bounds[-1]


def hist_delta(new: list[int], old: list[int], size: int) -> list[int]:
    """Counts between two cumulative reports of one histogram (`size` buckets); all of `new` when
    the counters went back (the worker restarted), nothing when `new` has the wrong size."""
    if len(new) != size:
        return [0] * size
    if len(old) != size or any(n < o for n, o in zip(new, old)):
        return list(new)
    return [n - o for n, o in zip(new, old)]


def _band_from_tier(message: InferenceRequest | UsageEvent | PlacementRequest) -> None:
    """A message written before `tier` was renamed `band`: its band is in `tier`."""
    if message.tier is not None:
        message.band, message.tier = message.tier, None


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
    top_k: int = -1  # -1: no limit (SGLang's convention)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False  # generate max_new_tokens whatever the model would say (benchmarks)
    stop_token_ids: list[int] = []
    # Constrained decoding, at most one set (SGLang's sampling parameters of the same names);
    # json_schema is the schema as JSON text.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # False: the engine's text keeps special tokens (a tool-call parser reads markers that are special
    # tokens, gpt-oss's harmony ones).
    skip_special_tokens: bool = True
    logprobs: bool = False  # return each generated token's logprob
    top_logprobs: int = 0  # and this many most likely alternatives per position

    @property
    def constrained(self) -> bool:
        """Decoding follows a grammar, which restarts with every engine request: such an output
        cannot be continued from its text by another attempt, only started again."""
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None


class TokenLogprob(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """One generated token's logprob and its most likely alternatives (token text, logprob)."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = []
    # The token ids of `token` and of `top` (-1 / []: not known), for the gateway to decode the text
    # in context (inferbus.openai.token_text).
    token_id: int = -1
    top_ids: list[int] = []


class InferenceRequest(_Message, tag="request"):
    """Gateway → worker, on `request_subject`. One per attempt; `attempt` > 0 is a migration."""

    request_id: str
    tenant: str
    model: str
    prompt: str  # rendered the way the engine sees it (see inferbus.tokens.prompt)
    sampling: SamplingParams
    reply_to: str  # token subject of the gateway holding the client (events are batched per gateway)
    deadline: float  # unix seconds; past it the worker aborts
    created: float  # unix seconds when the gateway accepted the request
    kind: Literal["chat", "completion"] = "chat"
    adapter: str | None = None
    band: Band = "standard"
    tier: Band | None = None  # `band` as older writers named it: read, never written
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
    batch_line: int = -1  # for lines of a batch: the 0-based line of the input file
    # n > 1: which choice this engine request is (each its own request id); choices after the
    # first report no prompt tokens in their usage, since OpenAI bills the prompt once.
    choice: int = 0
    # The prompt as the served model's tokenizer encoded it (inferbus.tokens.prompt): the engine computes
    # on these ids, so what it caches is what was counted and hashed. Empty: the engine gets `prompt`.
    input_ids: list[int] = []
    # The release this request was assigned to (a canary's split, or a client's pin): the router
    # places it on a worker of that release only. None: any worker of the model.
    release: str | None = None
    release_pinned: bool = False  # the client pinned `release`: no other release may serve it
    # Its adapter has a canary running: the worker reports this request's latency and outcome per
    # adapter version (`WorkerLoad.adapter_outcomes`) for the canary's SLO gate.
    adapter_canary: bool = False
    # The client pinned a version of its adapter (an eval run): like `release_pinned`, not the
    # traffic whose latencies the SLO gates read.
    adapter_pinned: bool = False
    # Sent to an adapter canary's candidate version: the registered version's engine name, which
    # the gateway continues the request on if the candidate cannot be loaded before any token.
    adapter_fallback: str | None = None

    @property
    def pinned(self) -> bool:
        """A client's pin (release or adapter version): left out of the canaries' latency histograms."""
        return self.release_pinned or self.adapter_pinned
    # Migration: the token ids already streamed to the client; the next attempt continues from
    # input_ids + resumed_ids (re-tokenizing the text could change token boundaries).
    resumed_ids: list[int] = []
    # Prefill/decode disaggregation: the prefill worker the router paired with the decode worker
    # this request is queued for, and the prompt tokens it expects that prefill worker to hold
    # cached. None: the decode worker that takes the request finds a prefill worker itself.
    prefill_worker: str | None = None
    prefill_cached_tokens: int = 0

    def on_wire(self) -> "InferenceRequest":
        """The copy published on the bus. With `input_ids` set the engine computes on the ids, so the
        prompt's text stays with the sender (which keeps it to continue from text if it must):
        carrying both nearly doubles a long prompt, and a 120k-token prompt's text plus ids
        exceeded NATS's default 1 MiB max_payload."""
        return msgspec.structs.replace(self, prompt="") if self.input_ids and self.prompt else self

    def engine_rid(self) -> str:
        """Fixed-length engine request id: SGLang's abort matches rids by prefix."""
        return f"{self.request_id}-{self.attempt:02d}"

    def __post_init__(self) -> None:
        _band_from_tier(self)


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
    logprobs: list[TokenLogprob] | None = None  # of this chunk's tokens, when the request asked
    token_ids: list[int] = []  # the ids of `text` (the engine's output_ids since the previous chunk)
    worker_id: str = ""  # on a stream's first chunk: who runs it, should its `Accepted` be lost


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
    logprobs: list[TokenLogprob] | None = None  # of `text`'s tokens, when the request asked
    token_ids: list[int] = []  # the ids of `text`


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


class StreamFrame(_Message):
    """Worker → gateway on `token_subject(gateway)`: the events for that gateway's requests that
    became ready together (one engine step's tokens for many streams, gathered for up to the
    worker's frame window), in order per request."""

    events: list[StreamEvent]


class ResendRequest(_Message):
    """Gateway → worker on `resend_subject(worker_id, gateway_id)`, or every worker on
    `holder_subject(gateway_id)` (request/reply; there only the holder answers): send again the
    stream events of one attempt from chunk `from_seq` on, because the gateway saw a gap in its
    chunks or heard nothing for a while (core NATS drops what is in flight when a node dies or a
    connection moves, and a lost last event would otherwise hold the client until its timeout)."""

    request_id: str
    attempt: int
    from_seq: int


class ResendReply(_Message):
    """`running`: the worker still generates the attempt; `finished`: it ended and its last events
    were sent again; `unknown`: the worker cannot resend them (it never had the attempt, or it no
    longer keeps the events asked for), so the gateway continues the request elsewhere."""

    state: Literal["running", "finished", "unknown"]
    resent: int = 0  # events sent again (to the request's reply_to, as one StreamFrame)
    worker_id: str = ""


class Dispatch(_Message):
    """A gateway (or the batch service) → billing, in the `dispatches` bucket: this request was
    queued for `tenant`, its events to `reply_to`. Only those identities may write it."""

    request_id: str
    tenant: str
    reply_to: str
    created: float


class Cancel(_Message):
    request_id: str
    reason: Literal["client_disconnect", "deadline", "admin", "superseded"] = "client_disconnect"
    # -1: every attempt of the request. Otherwise only that attempt: the gateway gave it up (its
    # worker was declared dead, never started it, or its stream broke) and continues elsewhere.
    attempt: int = -1
    # A client gone: the completion tokens (client-visible total) the gateway had written to it
    # when it left; the tenant is billed those, the rest the engine made is the platform's. -1: unknown.
    delivered_tokens: int = -1


class UsageEvent(_Message):
    """Worker (or gateway, when no worker finished it) → billing, on the USAGE stream.

    Exactly one per client request (ledger key `request_id`, see `usage_msg_id`), published with
    the `Nats-Msg-Id` of `usage_publish_id`.
    """

    request_id: str
    tenant: str
    model: str
    status: Literal["completed", "cancelled", "failed"]
    usage: Usage
    started: float
    finished: float
    adapter: str | None = None
    band: Band = "standard"
    tier: Band | None = None  # `band` as older writers named it: read, never written
    worker_id: str = ""
    attempts: int = 1
    finish_reason: str | None = None
    api_key_id: str = ""
    batch_id: str | None = None
    # "tenant": what the client was delivered (the request's one billable event, id request_id).
    # "platform": the work of an attempt the platform abandoned (migration, false death verdict,
    # a worker that never started it); the platform's cost, published with id
    # `<request_id>.<attempt>.abandoned` and rolled up apart from the tenant's bill.
    billed_to: Literal["tenant", "platform"] = "tenant"
    attempt: int = 0  # the attempt this event reports (0 for the first)
    release: str = ""  # the release (`Release.id`) of the worker that did the work; "" unpinned

    def __post_init__(self) -> None:
        _band_from_tier(self)


def usage_msg_id(event: UsageEvent) -> str:
    """The ledger key of a usage event: the rollups count each key once, whoever reported it."""
    if event.billed_to == "platform":
        return f"{event.request_id}.{event.attempt}.abandoned"
    return event.request_id


def usage_publish_id(event: UsageEvent, reporter: str, nonce: str) -> str:
    """The JetStream message id (`Nats-Msg-Id`) a usage event is published with: its ledger key,
    the reporter (`w.<worker>` or `o.<gateway>`, as in its subject) and `nonce`, a secret the
    reporter draws once per event (`new_usage_nonce`) and keeps for its retries.

    JetStream drops a message whose id it stored within the duplicate window, whoever published
    it, and no permission binds an id to a subject. An id anyone could compute (the request id, or
    the id with the reporter's name) lets an identity that knows a request id publish first and
    have the holder's genuine report dropped as a duplicate. With the nonce only the reporter's own
    retries of the same event are dropped; reports of one key by anyone else are all stored, and
    the rollups, which count a key once and never count a refused report, decide."""
    return f"{usage_msg_id(event)}.{reporter}.{nonce}"


def new_usage_nonce() -> str:
    """A fresh `usage_publish_id` nonce: 96 random bits."""
    return secrets.token_hex(12)


def batch_result_publish_id(result: BatchLineResult, reporter: str, nonce: str) -> str:
    """The JetStream message id of a line's result: `<request id>.<w | o>.<reporter>.<nonce>`, as
    `usage_publish_id` and for the same reason: an id anyone could compute (the request id) let
    the first publisher of it have every later result of the line dropped as a duplicate. The
    reporter draws `nonce` once per result (`new_usage_nonce`) and keeps it for its retries."""
    return f"{result.request_id}.{reporter}.{nonce}"


def batch_request_id(batch_id: str, line: int) -> str:
    """The request id of one line of a batch: stable across attempts and restarts, so the line is
    idempotent everywhere a request id is (usage dedup, results, cancels)."""
    return f"{batch_id}-{line}"


BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
BATCH_TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


class RequeueReply(_Message):
    """Batch service → worker, the answer to a line handed back on `requeue_subject(owner)` (the
    request is the line's next attempt, an `InferenceRequest`): whether its next attempt is
    queued, else why not."""

    queued: bool
    why: str = ""


class BatchLineResult(_Message):
    """How one line of a batch ended, on JetStream `BATCH_RESULTS` with the message id of
    `batch_result_publish_id`. A worker publishes it on `batch_result_subject(batch, "w", itself)`
    after the line's usage event, only from the attempt that finished it (a preempted attempt hands
    the line back to the queue instead). The batch service takes it only from the worker that holds
    the line's attempt and then records it as the line's result on its own subject
    (`batch_result_subject(batch, "o", batch-<id>)`), where it also publishes the lines it ends
    itself. Readers count the first result per line on the batch service's subjects only
    (`batch_results_kept_filter`) and log the rest (`services/batch/results.py`)."""

    batch_id: str
    line: int
    request_id: str
    attempt: int
    finished: float
    worker_id: str = ""
    ok: bool = True
    text: str = ""  # the whole completion, resumed text included
    finish_reason: str | None = None
    matched_stop: str | None = None
    usage: Usage | None = None
    # When not ok: an OpenAI error code and message, and the HTTP status the line would have had.
    error_code: str | None = None
    error_message: str | None = None
    status: int = 200


class BatchErrorEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of a batch's `errors.data` (validation failures)."""

    code: str
    message: str
    line: int | None = None  # 1-based, as editors count
    param: str | None = None


class BatchUsage(msgspec.Struct, kw_only=True, omit_defaults=True):
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class BatchRecord(_Message):
    """The durable record of one batch: value of `batch_key(tenant, batch_id)` in the `batches`
    KV bucket. The gateway creates it (validating) and may move it to cancelling; the batch
    service owns every other transition. Writers use compare-and-set on the KV revision."""

    id: str
    tenant: str
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"  # a BatchStatus; a plain str so a future status does not break readers
    api_key_id: str = ""
    metadata: dict[str, str] | None = None
    model: str = ""  # the one model every line names (known after validation)
    total: int = 0
    completed: int = 0
    failed: int = 0
    usage: BatchUsage = msgspec.field(default_factory=BatchUsage)
    errors: list[BatchErrorEntry] = []
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None


class FileRecord(_Message):
    """Metadata of an uploaded or generated file (the bytes live in the file store)."""

    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # "batch" (uploads) or "batch_output" (a batch's output and error files)
    status: str = "processed"
    expires_at: int | None = None


class StoredResponse(_Message):
    """A stored Responses-API response (`responses` KV bucket): the response object and the
    conversation's input items that produced it, both as their JSON wire bytes."""

    id: str
    tenant: str
    created_at: int
    response: bytes  # the `response` object
    input_items: bytes  # JSON list: the previous responses' items, then this request's input


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
    # Autoscaling (all optional; older workers send none of them).
    # "starting" (engine loading), "warm" (engine loaded, pulls nothing until promoted) or
    # "serving". A plain str, not a Literal, so that a future phase does not break older readers.
    # Only serving workers offer slots: starting and warm ones report max_running = 0.
    phase: str = "serving"
    batch_in_flight: int = 0  # of `in_flight`, requests of the batch band (preemptible filler)
    completed_batch: int = 0  # of `completed`, batch-band requests (a counter)
    # Of `in_flight`, batch lines without a first token yet (queued in the engine or prefilling):
    # `waiting - batch_waiting` estimates the interactive requests an engine keeps waiting.
    batch_waiting: int = 0
    # Interactive requests only, cumulative counts since the worker started, one per bucket of
    # LATENCY_BUCKETS_S / TPOT_BUCKETS_S (plus one for +inf): deltas between two reports give the
    # exact distribution in between, and a lost report loses nothing. A reader ignores a histogram
    # of another size (hist_delta), so workers and readers of different releases lose the signal
    # for the upgrade rather than misread it.
    ttft_hist: list[int] = []  # gateway accept → first token
    queue_wait_hist: list[int] = []  # gateway accept → engine submit
    tpot_fine_hist: list[int] = []  # mean time per output token after the first, per request
    # The engine's GPU type and tensor-parallel width ("" / 0: unknown): readers size the batch
    # step-time cap with them (`inferbus.step_cost`).
    gpu: str = ""
    tp: int = 0
    # Releases (all optional): what this worker serves, and interactive requests it finished by
    # status since it started (counters; the canary's SLO gate reads their deltas per release).
    release: str = ""
    finished_ok: int = 0
    finished_failed: int = 0
    finished_cancelled: int = 0
    # Requests this worker holds per LoRA adapter ("" for the base model): the distinct adapters its
    # engine's batch needs, against the heartbeat's `max_adapters` slots.
    adapter_requests: dict[str, int] = {}
    # LoRA adapter loads queued or in flight here (the engine loads one at a time): adapter →
    # expected seconds until it is ready, its place in the queue included. A request for one of
    # them waits that long; one for any other adapter not loaded waits for the whole queue plus
    # `adapter_load_s`, this worker's expected seconds for one more load (0: not measured yet).
    adapter_loads: dict[str, float] = {}
    adapter_load_s: float = 0.0
    adapter_prefetches: int = (
        0  # prefetches into host memory queued or loading here (not in adapter_loads until they start)
    )
    # Per adapter engine name (a version), for requests of adapters with a canary running
    # (`InferenceRequest.adapter_canary`): cumulative histograms and outcomes, as above.
    adapter_outcomes: dict[str, AdapterOutcomes] = {}
    role: str = "aggregated"  # a `Role` (as in the worker's Heartbeat): which pool this load belongs to
    # The bands this worker pulls (empty: not said, as older workers): its free slots take only
    # requests of these.
    bands: list[Band] = []


class AdapterOutcomes(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One adapter version's interactive requests on one worker since it started (cumulative)."""

    ttft_hist: list[int] = []
    tpot_fine_hist: list[int] = []
    finished_ok: int = 0
    finished_failed: int = 0
    finished_cancelled: int = 0


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
    block_size: int = 0  # tokens per prefix block of the cache events this worker relays (0: it relays none)
    max_adapters: int = 0  # distinct LoRA adapters per batch, the base model counting as one (0: no LoRA)
    max_loaded_adapters: int = 0  # adapters the engine keeps loaded before evicting (0: no limit)
    release: str = ""  # the release (`Release.id`) this worker verified it serves; "" unpinned
    zone: str = ""  # failure domain (availability zone) of the worker; "" = none given
    role: str = "aggregated"  # a `Role`: what this worker's engine does (prefill/decode disaggregation)
    bands: list[Band] = []  # the priority bands it pulls, most important first ([] from older workers)
    # A decode engine that can also compute a prompt itself (none of SGLang 0.5.23's can: its decode
    # mode takes every prompt's KV from a prefill engine); the router may then let it prefill a short
    # uncached remainder rather than send it to a prefill worker (conditional disaggregation).
    local_prefill: bool = False
    kv_capacity_tokens: int = 0  # the engine's KV cache in tokens (0: unknown): a decode worker's room
    context_length: int = 0  # the context window its engine enforces (0: unknown)


class LivenessProbe(_Message):
    """Gateway → worker on `liveness_subject(worker_id)` (request/reply), before it declares the
    worker dead on a missed heartbeat. Answered from the worker's liveness thread, on its own NATS
    connection, so a worker whose event loop is busy still answers."""

    worker_id: str


class LivenessReply(_Message):
    worker_id: str
    loop_lag_s: float  # seconds since the worker's event loop last ran its tick


class PlacementRequest(_Message):
    """Gateway → router on `placement_subject(model)` (request/reply)."""

    request_id: str
    model: str
    prompt_tokens: int
    adapter: str | None = None
    band: Band = "standard"
    tier: Band | None = None  # `band` as older writers named it: read, never written
    # `inferbus.tokens.blocks.block_hashes(input_ids, block_size, namespace=adapter)`: the chained prefix
    # blocks of the prompt's token ids, which workers rebuild their engines' cache events into, so
    # the router can count blocks a worker already holds.
    block_hashes: list[int] = []
    block_size: int = 0
    release: str | None = None  # place on a worker of this release only (InferenceRequest.release)
    pinned: bool = False  # the client asked for `release`: no other release may serve it
    zone: str = ""  # the asking gateway's zone: placement prefers workers there while they have room
    # "prefill": a decode worker asks for a prefill worker for a request it holds (the reply's
    # `worker_id`); "" (a gateway): where the request runs, a pair on a disaggregated fleet.
    role: str = ""
    avoid: list[str] = []  # workers not to choose (a prefill worker that refused or failed this request)

    def __post_init__(self) -> None:
        _band_from_tier(self)


class PlacementReply(_Message):
    target: str  # `subjects.ANY_TARGET` or `subjects.worker_target(...)`
    worker_id: str | None = None
    reason: str = ""
    cached_blocks: int = 0  # leading blocks the router expects the chosen worker to hold
    # Disaggregated: the prefill worker paired with decode worker `worker_id`, and the leading blocks
    # it holds. None with a decode `worker_id`: that worker computes the prompt itself.
    prefill_worker_id: str | None = None
    prefill_cached_blocks: int = 0


class PrefillRequest(_Message, tag="prefill"):
    """Decode worker → prefill worker on `prefill_subject(prefill, decode)` (request/reply, answered
    with `PrefillAccepted`): compute the prompt of `request` on your engine and send its KV to the
    decode engine waiting in `bootstrap_room` (SGLang's PD protocol: the same request goes to both
    engines with the bootstrap host, port and room). `try_no` > 0: an earlier prefill of this attempt
    failed; its engine rid is `prefill_rid(request, try_no)`."""

    request: InferenceRequest
    bootstrap_room: int
    try_no: int = 0
    placed: bool = False  # a router placed it on this prefill worker (counted against its placements)
    # When the decode worker first asked a prefill worker for this attempt's prompt (wall seconds,
    # kept across refusals and tries; 0: not said). The prefill pool's own TTFT starts here: the
    # time before it (the request waiting for a decode worker to take it) is the decode pool's.
    asked_at: float = 0.0


class PrefillAbort(_Message, tag="prefill_abort"):
    """Decode worker → prefill worker on `prefill_subject`: give up the prefill of this try (the
    decode side failed, or moved on to another prefill worker)."""

    request_id: str
    attempt: int
    try_no: int = 0


class PrefillStatus(_Message, tag="prefill_status"):
    """Decode worker → prefill worker on `prefill_subject` (request/reply, answered with
    `PrefillHeld`): do you still hold this try? Asked of a try whose KV has not arrived for a while
    without a report (a `PrefillDone` lost on the bus would otherwise leave the decode engine waiting
    for SGLang's 300 s timeout)."""

    request_id: str
    attempt: int
    try_no: int = 0


class PrefillHeld(_Message):
    held: bool  # the prefill worker still runs the try (false: it ended, and its report went out)
    worker_id: str = ""


PrefillMessage = Union[PrefillRequest, PrefillAbort, PrefillStatus]


class PrefillAccepted(_Message):
    """Prefill worker's answer to a `PrefillRequest`: where its engine's bootstrap server listens
    (`accepted`), or why not (`full`: every prefill slot taken; `draining`; `cancelled`)."""

    accepted: bool
    worker_id: str
    bootstrap_host: str = ""
    bootstrap_port: int = 0
    reason: str = ""


class PrefillDone(_Message):
    """Prefill worker → decode worker on `prefilled_subject(decode)`: the prefill of one try ended.
    `ok`: computed and its KV sent (SGLang answers the prefill request once the transfer is done);
    otherwise `code`/`message` say why, and the decode worker tries another prefill worker."""

    request_id: str
    attempt: int
    try_no: int
    worker_id: str
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the prompt tokens the prefill engine found in its prefix cache
    code: str = ""
    message: str = ""


def prefill_rid(request: InferenceRequest, try_no: int) -> str:
    """The engine rid of try `try_no` of `request`'s current attempt, on both engines: the attempt's
    rid, so that aborting the attempt (a prefix match in SGLang) aborts every try of it."""
    rid = request.engine_rid()
    return rid if try_no == 0 else f"{rid}.{try_no}"


class Placed(_Message):
    """Router → every router replica on `placed_subject(model)`: a placement just made, so that
    replicas count each other's placements (load and prefixes) before workers report them."""

    router_id: str
    worker_id: str
    model: str
    prefill_tokens: int  # prompt tokens the worker must compute (not expected to be cached)
    block_hashes: list[int] = []
    adapter: str | None = None
    prompt_tokens: int = 0  # the whole prompt, cached part included (0: an older router; take prefill_tokens)


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
    # A new version being canaried within the adapter's traffic (`inferbus release adapter-canary`):
    # the adapter's rollout (`adapter_rollout_key`) says which share of its requests it serves.
    candidate_version: str | None = None
    candidate_path: str | None = None

    @property
    def engine_name(self) -> str:
        return adapter_engine_name(self.name, self.version)

    @property
    def candidate_engine_name(self) -> str | None:
        return adapter_engine_name(self.name, self.candidate_version) if self.candidate_version else None

    def version_of(self, engine_name: str) -> tuple[str, str] | None:
        """(version, path) of the registered version engines know as `engine_name`, or None."""
        if engine_name == self.engine_name:
            return self.version, self.path
        if self.candidate_version and self.candidate_path and engine_name == self.candidate_engine_name:
            return self.candidate_version, self.candidate_path
        return None


def adapter_engine_name(name: str, version: str) -> str:
    """What engines call version `version` of adapter `name`: `<name>@<first 12 hex of the digest>`."""
    return f"{name}@{version.removeprefix('sha256:')[:12]}"


class ControlCommand(_Message):
    """Operator/autoscaler → worker on `control_subject`."""

    # promote: a warm worker starts pulling (the autoscaler's fast path); demote: a serving
    # worker stops pulling, finishes its in-flight work and goes back to warm. Older workers
    # cannot decode these two and ignore them.
    action: Literal["drain", "resume", "load_adapter", "unload_adapter", "resync_cache", "promote", "demote"]
    adapter: str | None = None
    adapter_path: str | None = None
    # load_adapter: a prefetch into host memory, made only while no load a request waits for is
    # queued there (router/adapter_prefetch.py); it becomes one if a request asks for the adapter.
    background: bool = False


class ScaleDecision(_Message):
    """Autoscaler → anyone on `scale_subject(pool)`: one per pool per tick, holds included.

    `serving`/`warm` are what the pool has now (as the autoscaler sees it), `desired_*` what it
    asks the actuator for; `reason` says why in words, with the signal values it used.
    """

    pool: str
    ts: float
    direction: Literal["up", "down", "hold"]
    serving: int
    warm: int
    starting: int
    draining: int
    desired_serving: int
    desired_warm: int
    reason: str
    autoscaler_id: str = ""
    actuator: str = ""
    # The signals behind it (seconds, requests per second, ratios); None where not observed.
    arrival_rate: float = 0.0
    forecast_rate: float = 0.0
    capacity_rate: float = 0.0  # what desired_serving replicas serve at the configured goodput
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    queue_wait_s: float = 0.0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    batch_in_flight: int = 0
    promote: list[str] = []  # warm workers promoted by this decision
    demote: list[str] = []  # serving workers sent back to warm (or drained) by it


class ModelFile(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One file of a model directory or adapter: its path inside the directory, size and digest."""

    path: str
    size: int
    sha256: str


class ReleaseAdapter(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    digest: str  # `sha256:<64 hex>` over the adapter's files (`inferbus.releases.record.tree_digest`)


class Release(_Message):
    """An immutable, content-addressed release of one served model: value of `release_key(id)` in
    the `models` KV bucket, written once. `id` is `sha256:` of the canonical encoding of every other
    field but `created` and `note` (`inferbus.releases.record.release_id`), so the same content is
    the same release and a changed byte is another one."""

    id: str
    model: str  # what clients put in `model`
    repo: str  # the checkpoint's repository id on its hub
    revision: str  # a full commit id (40 hex): branches and tags move, so they are refused
    files: list[ModelFile]  # every file of the model directory: weights, tokenizer, configs, template
    chat_template_sha256: (
        str  # the Jinja template the gateway renders with (inside tokenizer_config.json or its own file)
    )
    engine_image: str  # `<image>@sha256:<64 hex>`: the engine build
    # Engine flags that change behaviour (quantization, tp, speculative decoding, chunked-prefill
    # budget, ...), as the engine reports them in /server_info: the worker compares.
    engine_flags: dict[str, str] = {}
    adapters: list[ReleaseAdapter] = []
    created: float = 0.0
    note: str = ""


RolloutState = Literal["stable", "canary", "promoted", "rolled_back"]


class Rollout(_Message):
    """Where one model stands: value of `rollout_key(model)` in the `models` KV bucket (its history
    is the bucket's). Written with compare-and-set by `inferbus release` and the canary controller."""

    model: str
    stable: str  # the release serving everything not sent to the candidate
    state: str = "stable"  # a RolloutState
    # Set: this is the rollout of LoRA adapter `adapter` of `model` (key `adapter_rollout_key`),
    # and `stable`/`candidate` are versions of the adapter (the digest of its files), not releases.
    candidate: str | None = None
    share: float = 0.0  # of the model's traffic sent to the candidate (0-1)
    steps: list[float] = []  # the shares a canary goes through, the last being 1.0
    step: int = 0  # index into steps of `share`
    sticky: str = "tenant"  # "tenant" or "prefix": what keeps a client on one side of the split
    window_s: float = 300.0  # how long each step is observed before the gates are read
    eval_suite: str | None = None  # the suite whose verdict the eval gate waits for (None: no eval gate)
    eval_verdict: str | None = None  # "pass" / "fail" (with eval_reason), once `inferbus eval` reported
    eval_reason: str = ""
    started: float = 0.0
    step_started: float = 0.0
    updated: float = 0.0
    reason: str = ""  # why it is where it is, in words
    adapter: str | None = None


class ReleaseDecision(_Message):
    """The canary controller (or an operator) → anyone, on `release_subject(model)`: one per step
    advanced, hold, promotion or rollback, with the gates' numbers behind it."""

    model: str
    ts: float
    action: Literal["start", "hold", "advance", "promote", "rollback", "eval"]
    stable: str
    candidate: str | None
    share_before: float
    share_after: float
    reason: str
    slo: dict[str, float] = {}  # the SLO gate's measurements (p90s, rates, sample sizes)
    controller: str = ""
    adapter: str | None = None  # a decision of the canary of this adapter of `model` (versions, not releases)


# ---- internal producers (`subjects.api_subject`) ---------------------------------------------
# Their bodies are the HTTP API's JSON both ways, so that a producer needs no second schema: a
# request is a `/v1/chat/completions` or `/v1/completions` body (inferbus/openai/schemas.py), a
# reply is the response body, or one streamed chunk. These headers frame them.
API_VERSION = "1"
API_HEADER_VERSION = "Inferbus-Api-Version"
API_HEADER_STATUS = "Inferbus-Status"  # the HTTP status the same call would have had
API_HEADER_REQUEST_ID = "Inferbus-Request-Id"
API_HEADER_STREAM = "Inferbus-Stream"  # on the replies of a streamed call: "chunk", then "done"
API_HEADER_CANCEL = "Inferbus-Cancel"  # on a streamed call's first reply: publish here to abandon it
API_STREAM_CHUNK = "chunk"
API_STREAM_DONE = "done"


_encoder = msgspec.msgpack.Encoder()
_frame_decoder = msgspec.msgpack.Decoder(StreamFrame)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


def decode_stream_frame(data: bytes) -> StreamFrame:
    return _frame_decoder.decode(data)
