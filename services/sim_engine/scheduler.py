"""The simulated engine's scheduler: continuous batching over a virtual clock.

Pure: no asyncio, no I/O. Time is virtual and moves only with `Engine.step()` (by the step time
the perf model prices) and `Engine.advance()` (idle time the caller observed); the HTTP shell maps
it to wall time with `time_scale`, the closed-loop driver never sleeps at all.

Behaviour follows SGLang's scheduler where it is observable from the outside: chunked prefill
under a token budget, prefix-cache hits skipping prefill (reported as `cached_tokens`), requests
waiting while the KV pool is full and running ones retracted (recomputed later) when it
overflows, priority (larger is more important; ignored unless `priority_scheduling`, as SGLang's
--enable-priority-scheduling), LoRA slots per batch, and SGLang's finish
reasons and error messages.
"""

from __future__ import annotations

import math
import random
import struct
import uuid
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from inferbus.timing import LORA_LOAD_BANDWIDTH, FixedStepModel, SpecDecoding, StepTimeModel, roofline
from inferbus.tokens.blocks import VOCAB_SIZE, block_hashes, encode, pieces

from .config import ANSWER_LENGTH_SIGMA, EngineConfig
from .lora_pool import GpuSlots, LoadedAdapters, LoraAdapter, adapter_rank, disk_load_s, host_to_gpu_s
from .profile_table import TableStepModel, load_npz
from .radix_cache import RadixCache

MAX_STOP_SEQUENCES = 32
# Admission reserves room for this share of each running request's remaining output (capped per
# request), like SGLang's new_token_ratio estimate; an underestimate is fixed by retraction.
NEW_TOKEN_RATIO = 0.3
CLIP_MAX_NEW_TOKENS_ESTIMATE = 4096
# Host memory to GPU over PCIe Gen5 x16, achieved (the planner's adapter-load rate, inferbus/timing.py).
HOST_TO_DEVICE_BANDWIDTH = LORA_LOAD_BANDWIDTH
EOS_TOKEN_ID = 128009  # Llama-3's <|eot_id|>: the finish `matched` of an output that ended by itself


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """SGLang's `sampling_params`: unknown keys and wrong types are errors, as in SGLang."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None

    def verify(self) -> None:
        """Raise ValueError with SGLang's wording when a value is out of range."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 <= self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in [0, 2], got {self.repetition_penalty}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if not 0 <= self.min_new_tokens <= self.max_new_tokens:
                raise ValueError(
                    f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                    f"got {self.min_new_tokens}."
                )
        elif self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported), got {self.n}.")
        if sum(grammar is not None for grammar in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop supports at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(stop for stop in stops if stop)


# Output vocabulary: common English words (each one stand-in token), with punctuation and
# newlines mixed in so that stop sequences such as "." or "\n" do match.
_WORDS = """
the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has
look two more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work know place
year live me back give most very after thing our just name good man think say great where help
much before line right too mean old any same tell boy follow came want show also around form three
small set put end does well large must big even such turn here why ask went men read need land
differ home us move try kind hand again change off play spell air away animal house point page
letter mother answer found study still learn should world high every near add food own below
plant last school father keep tree never start city earth eye light though head under story saw
left few while along might close open seem next hard begin life always those both paper often run
music color stand sun fish area mark dog horse birds told knew pass since top whole king space
heard best hour better true during step early hold west ground reach fast five sing listen six
table travel less ten simple toward war lay slow center love person money serve appear road map
rain rule govern pull cold notice voice unit power town fine drive lead cry dark note wait plan
figure star box noun field rest able pound done beauty stood front teach week final gave green
quick ocean warm free minute strong mind behind clear tail fact street inch course stay wheel full
force blue object decide deep moon island foot system busy test record boat common gold plane age
dry wonder laugh ago ran check game shape yes hot miss heat snow tire bring fill east paint among
""".split()
OUTPUT_PIECES: tuple[str, ...] = (
    tuple(" " + word for word in _WORDS if len(word) <= 6)
    + ("." ,) * 24
    + ("," ,) * 16
    + ("\n",) * 6
)
_PIECE_IDS: dict[str, int] = {piece: encode(piece)[0] for piece in set(OUTPUT_PIECES)}


@dataclass(frozen=True)
class OutputVocabulary:
    """The (token id, text) pairs output is drawn from: single tokens of the served model's
    vocabulary, so that output_ids decode to the text, or the stand-in tokenizer's pieces; how an
    output decided up front (a JSON value, a tool call) splits into tokens; the EOS token id."""

    tokens: tuple[tuple[int, str], ...]
    split: Callable[[str], list[tuple[int, str]]]
    eos_id: int

    @classmethod
    def standin(cls) -> OutputVocabulary:
        return cls(tuple((_PIECE_IDS[piece], piece) for piece in OUTPUT_PIECES),
                   lambda text: [(encode(piece)[0], piece) for piece in pieces(text)], EOS_TOKEN_ID)

    @classmethod
    def from_tokenizer(cls, encode_text: Callable[[str], list[int]], decode_id: Callable[[int], str],
                       eos_id: int) -> OutputVocabulary:
        """The output pieces that are one token of the model's vocabulary (readable words); with
        too few of those (a tiny vocabulary), every piece's tokens. A token's text is its decoding,
        so output ids always decode to the text."""

        def split(text: str) -> list[tuple[int, str]]:
            return [(token_id, decode_id(token_id)) for token_id in encode_text(text)]

        per_piece = [split(piece) for piece in OUTPUT_PIECES]
        whole = [tokens[0] for tokens in per_piece if len(tokens) == 1]
        if len({text for _, text in whole}) >= 32:
            return cls(tuple(whole), split, eos_id)
        return cls(tuple(token for tokens in per_piece for token in tokens), split, eos_id)


_STANDIN_VOCABULARY = OutputVocabulary.standin()


class RequestRejected(Exception):
    """The request cannot be accepted (SGLang answers these with HTTP 400)."""


@dataclass(eq=False, slots=True)
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    lora_name: str | None = None
    # Filled by the engine.
    lora: LoraAdapter | None = None  # the loaded adapter it runs with (kept if the adapter is evicted meanwhile)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    # A decode engine of a prefill/decode pair backs a retracted request's KV up to host memory and
    # restores it on readmission instead of recomputing it (SGLang's decode retraction backup).
    backed_up: bool = field(default=False, init=False)
    # Scheduling state: `fill_ids` are the tokens whose KV must exist before decoding (the
    # prompt, plus the output so far after a retraction); `computed` of them have KV; the first
    # `locked` blocks of `hashes` are pinned in the cache, `private` tokens are held outside it.
    fill_ids: list[int] = field(default_factory=list, init=False)
    hashes: list[int] = field(default_factory=list, init=False)
    computed: int = field(default=0, init=False)
    locked: int = field(default=0, init=False)
    private: int = field(default=0, init=False)
    order: int = field(default=0, init=False)
    max_new_tokens: int = field(default=0, init=False)
    # Hash of the whole context so far (prompt + output ids), salted for sampled requests.
    context_hash: int = field(default=0, init=False)
    stops: tuple[str, ...] = field(default=(), init=False)
    # Free text ends with EOS after this many output tokens (0: only at max_new_tokens or a stop).
    answer_length: int = field(default=0, init=False)
    # An output decided up front (constrained decoding, a tool call): emitted a token at a time,
    # then EOS.
    script: list[tuple[int, str]] | None = None  # (token id, text) per step
    # SGLang's return_logprob / top_logprobs_num: per output token (logprob, token id, text) and
    # the top alternatives in the same shape.
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_logprobs: list[tuple[float, int, str]] = field(default_factory=list, init=False)
    top_logprobs: list[list[tuple[float, int, str]]] = field(default_factory=list, init=False)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.fill_ids)

    @property
    def context_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """A request's state after a step (or an abort): what the shell streams to the client."""

    request: Request
    text: str
    num_output_tokens: int
    finish_reason: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float
    updates: list[RequestUpdate]
    batch_decode: int = 0
    prefill_tokens: int = 0
    # Nothing could run (no requests, or all waiting on something only an outside event changes).
    idle: bool = False


@dataclass(frozen=True, slots=True)
class LoraUpdateResult:
    success: bool
    error_message: str | None
    loaded_adapters: dict[str, str]
    evicted: tuple[str, ...] = ()  # unloaded to stay within --max-loaded-loras


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    cache_hit_rate: float
    max_running_requests: int


def lora_path_exists(path: str) -> bool:
    """The simulator's stand-in for a file check: paths starting with "missing" or "bad" fail."""
    return bool(path) and not path.startswith(("missing", "bad"))


class Engine:
    def __init__(self, config: EngineConfig, step_model: StepTimeModel | None = None,
                 vocabulary: OutputVocabulary = _STANDIN_VOCABULARY) -> None:
        self.config = config
        self.vocabulary = vocabulary.tokens
        self.split_output = vocabulary.split
        self.eos_id = vocabulary.eos_id
        self.spec = (SpecDecoding(config.speculative_num_steps, config.speculative_acceptance,
                                  config.speculative_draft_cost) if config.speculative_num_steps else None)
        # Adapter slots are not taken out of the KV cache here (the planner does take them out).
        roofline_model = roofline(
            config.gpu, config.tp, config.preset,
            weights="fp8" if config.quantization == "fp8" else "bf16",
            kv_cache="fp8" if config.kv_cache_dtype == "fp8_e4m3" else "bf16",
            spec=self.spec, lora_rank=config.priced_lora_rank,
        )
        # Which draft tokens the target accepts: seeded, so a run replays exactly.
        self._spec_rng = random.Random(0)
        if step_model is None:
            if config.fixed_step_ms is not None:
                step_model = FixedStepModel(config.fixed_step_ms / 1000.0)
            elif config.profile_table is not None:
                step_model = TableStepModel(load_npz(config.profile_table))
            else:
                step_model = roofline_model
        self.step_model: StepTimeModel = step_model
        capacity = config.kv_capacity_tokens or roofline_model.kv_capacity_tokens()
        self.cache = RadixCache(capacity_tokens=capacity, block_size=config.block_size)
        self.now = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.held: list[Request] = []  # accepted, not schedulable yet (`add(held=True)`)
        self.adapters = LoadedAdapters(config.max_loaded_loras)
        self.gpu_slots = GpuSlots(config.max_loras_per_batch, config.lora_eviction_policy)
        # --enable-lora-overlap-loading: adapters being copied into GPU slots beside the steps → when
        # the copy is done (one copy stream: copies follow each other), and when that stream is free.
        self.gpu_copies: dict[str, float] = {}
        self.copy_stream_free_at = 0.0
        # SGLang's scheduler reads an adapter from disk inside its own loop (`load_lora_adapter` is
        # dispatched with the requests it receives), so no batch runs until the read is done, and
        # loads follow each other: when the last one asked for is done.
        self.loading_until = 0.0
        self.lora_loads_total = 0  # from disk into host memory, implicit reloads included
        self.lora_evictions_total = 0  # unloaded to stay within --max-loaded-loras
        # Every adapter loaded since start (SGLang's lora_ref_cache): a request for one that was
        # unloaded since loads it again implicitly; one never loaded is refused.
        self.adapters_seen: dict[str, tuple[str, bool]] = {}
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self._restore_s = 0.0  # KV restores from host memory the next step waits for
        self._kv_bytes_per_token = roofline_model.model.kv_bytes_per_token
        self._requests: dict[str, Request] = {}
        self._next_order = 0

    # ------------------------------------------------------------------ requests

    def add(self, request: Request, *, held: bool = False) -> None:
        """Queue a request; raises RequestRejected with SGLang's message when it cannot run.

        `held`: accepted but kept out of scheduling until `release` or `start_transferred` (a
        request of a prefill/decode pair waiting for the other engine)."""
        if request.rid in self._requests:
            raise RequestRejected("Duplicate request ID detected")
        if not self.config.priority_scheduling:
            request.priority = 0  # as SGLang without --enable-priority-scheduling: ignored
        if request.lora_name is not None and request.lora_name not in self.adapters:
            if request.lora_name not in self.adapters_seen:
                raise RequestRejected(
                    f"Got LoRA adapter that has never been loaded: {request.lora_name}\n"
                    f"All loaded adapters: {self.adapters_seen.keys()}."
                )
            path, pinned = self.adapters_seen[request.lora_name]
            reloaded = self.load_lora(request.lora_name, path, pinned)
            if not reloaded.success:
                raise RequestRejected(
                    f"Failed to implicitly load LoRA adapter {request.lora_name}: {reloaded.error_message}"
                )
        if request.lora_name is not None:
            adapter = self.adapters[request.lora_name]
            if adapter.broken:
                raise RequestRejected(
                    f"Failed to load LoRA adapter {adapter.name} from {adapter.path}: no such adapter (simulated).")
            self.adapters.touch(request.lora_name)  # SGLang's registry `acquire`: most recently used
            request.lora = adapter
        prompt_len = len(request.input_ids)
        if prompt_len == 0:
            raise RequestRejected("The input is empty: send text or input_ids with at least one token.")
        if prompt_len >= self.config.context_length:
            raise RequestRejected(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.config.context_length} tokens)."
            )
        if prompt_len + 1 > self.cache.capacity_tokens:
            raise RequestRejected(
                f"The input ({prompt_len} tokens) does not fit in the KV cache "
                f"({self.cache.capacity_tokens} tokens)."
            )
        sampling = request.sampling
        limit = self.config.context_length - prompt_len
        request.max_new_tokens = limit if sampling.max_new_tokens is None else min(sampling.max_new_tokens, limit)
        request.stops = sampling.stop_strings()
        request.context_hash = _context_hash(request)
        request.answer_length = self._answer_length(request)
        request.arrival_time = self.now
        request.order = self._next_order
        self._next_order += 1
        self._set_fill(request, request.input_ids)
        self.prompt_tokens_total += prompt_len
        self._requests[request.rid] = request
        (self.held if held else self.waiting).append(request)

    def _answer_length(self, request: Request) -> int:
        """Where the model would end its free text by itself: drawn from the configured
        distribution, seeded by the context (so a greedy request answers alike every time, a sampled
        one by its seed); 0 with ignore_eos or without a distribution."""
        median = self.config.answer_length_median
        if median <= 0 or request.sampling.ignore_eos:
            return 0
        draw = random.Random(request.context_hash).gauss(0.0, 1.0)
        return max(1, round(median * math.exp(ANSWER_LENGTH_SIGMA * draw)))

    def release(self, rid: str) -> None:
        """A held request may be scheduled now (its decode engine has said where the KV goes)."""
        request = self._requests[rid]
        self.held.remove(request)
        self.waiting.append(request)

    def start_transferred(self, rid: str, first_token: tuple[int, str] | None, cached_tokens: int,
                          reserved_tokens: int, matched_blocks: int = 0) -> RequestUpdate:
        """Start decoding a held request whose prompt KV another engine computed and sent (the
        decode role of prefill/decode disaggregation): `reserved_tokens` of the pool hold that KV,
        the first `matched_blocks` blocks of its hashes are this engine's cache (locked by the
        caller), the prefill's sampled token is its first output (None: this engine samples it, as
        after SGLang's fake transfer), `cached_tokens` the prefill's hits."""
        request = self._requests[rid]
        self.held.remove(request)
        request.computed = len(request.fill_ids)
        request.private = reserved_tokens
        request.locked = matched_blocks
        request.cached_tokens = cached_tokens
        self.cached_tokens_total += cached_tokens
        self.running.append(request)
        if request.max_new_tokens == 0:
            return self._retire(request, {"type": "length", "length": 0})
        return self._emit_token(request, first_token)

    def abort(
        self, rid_prefix: str, message: str = "Abort by user request.", *, exact: bool = False
    ) -> list[RequestUpdate]:
        """Abort every request whose rid starts with `rid_prefix` ("" aborts all), as SGLang does.

        `exact` matches the whole rid only (a client disconnect must not stop its neighbours).
        """
        if exact:
            matches = [self._requests[rid_prefix]] if rid_prefix in self._requests else []
        else:
            matches = [r for rid, r in self._requests.items() if rid.startswith(rid_prefix)]
        updates = []
        for request in matches:
            if request in self.running:
                self.running.remove(request)
                self._free(request, cache_blocks=True)
            elif request in self.held:
                self.held.remove(request)
            else:
                self.waiting.remove(request)
            updates.append(self._finish(request, {"type": "abort", "message": message}))
        return updates

    def get(self, rid: str) -> Request | None:
        return self._requests.get(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def advance(self, seconds: float) -> None:
        """Let idle time pass (the shell calls this after waiting for work)."""
        if seconds > 0:
            self.now += seconds

    # ------------------------------------------------------------------ LoRA

    def load_lora(self, name: str, path: str, pinned: bool = False) -> LoraUpdateResult:
        if name in self.adapters:
            return self._lora_result(False, f"The LoRA adapter {name} is already loaded.")
        broken = not lora_path_exists(path)
        if broken and not self.config.lazy_lora_loading:
            return self._lora_result(
                False, f"Failed to load LoRA adapter {name} from {path}: no such adapter (simulated)."
            )
        rank = adapter_rank(path, self.config.priced_lora_rank)
        self.loading_until = max(self.now, self.loading_until) + self.lora_disk_load_s(rank)
        adapter = LoraAdapter(name, path, pinned, ready_at=self.loading_until, broken=broken, rank=rank)
        evicted = self.adapters.add(adapter)
        for victim in evicted:
            self.gpu_slots.drop(victim)
        self.adapters_seen[name] = (path, pinned)
        self.lora_loads_total += 1
        self.lora_evictions_total += len(evicted)
        return self._lora_result(True, None, tuple(evicted))

    def lora_disk_load_s(self, rank: int) -> float:
        """Simulated seconds from disk into host memory: --lora-load-time when given, else from the size."""
        fixed = self.config.lora_load_time_s
        return disk_load_s(rank) if fixed is None else fixed

    def unload_lora(self, name: str) -> LoraUpdateResult:
        if self.adapters.remove(name) is None:
            return self._lora_result(False, f"LoRA adapter {name} is not loaded.")
        self.gpu_slots.drop(name)
        return self._lora_result(True, None)

    def _lora_result(self, success: bool, error: str | None, evicted: tuple[str, ...] = ()) -> LoraUpdateResult:
        return LoraUpdateResult(success, error, {name: a.path for name, a in self.adapters.items()}, evicted)

    # ------------------------------------------------------------------ observability

    def load(self) -> LoadSnapshot:
        cache = self.cache
        # Like SGLang: tokens held by requests, not evictable cache.
        used = cache.capacity_tokens - cache.available_tokens()
        return LoadSnapshot(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_used_tokens=used,
            max_total_num_tokens=cache.capacity_tokens,
            token_usage=used / cache.capacity_tokens,
            cache_hit_rate=self.cache_hit_rate,
            max_running_requests=self.config.max_running_requests,
        )

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused while requests are queued or running (as SGLang)."""
        if self.has_work:
            return False
        return self.cache.clear()

    # ------------------------------------------------------------------ the step

    def step(self) -> StepResult:
        """Run one iteration: decode every running sequence, prefill up to the token budget."""
        updates: list[RequestUpdate] = []
        if self.loading_until > self.now:  # the scheduler is reading an adapter from disk: no batch runs
            wait = self.loading_until - self.now
            self.now = self.loading_until
            return StepResult(wait, updates)
        if self.config.mixed_chunk:
            decoding = self._reserve_decode_slots()
            self._admit(updates)
            chunks = self._plan_prefill()
        else:  # a prefill step when there is prefill work, else a decode step
            self._admit(updates)
            chunks = self._plan_prefill()
            decoding = [] if chunks else self._reserve_decode_slots()
        restore_s, self._restore_s = self._restore_s, 0.0
        if not decoding and not chunks:
            if restore_s:
                self.now += restore_s
                return StepResult(restore_s, updates)
            return self._wait_for_adapters(updates)

        resident = sum(r.context_len for r in decoding)
        prefill_tokens = sum(size for _, size in chunks)
        # Mean attended context of a prefill token: the chunk's start plus half the chunk.
        attended = sum(size * (r.computed + size / 2) for r, size in chunks)
        batch_adapters = {r.lora_name for r in decoding} | {r.lora_name for r, _ in chunks}
        adapters = len(batch_adapters - {None})
        duration = self.step_model.step_time(
            len(decoding), resident, prefill_tokens, attended / prefill_tokens if prefill_tokens else 0.0, adapters
        ) + self._copy_adapters_to_gpu(batch_adapters, [*decoding, *(r for r, _ in chunks)]) + restore_s
        self.now += duration

        for request in decoding:
            update = self._emit_token(request)
            if self.spec is not None and update.finish_reason is None:
                # One update per request and step, carrying every token the step produced.
                update = self._emit_accepted_drafts(request) or update
            updates.append(update)
        for request, size in chunks:
            request.computed += size
            self._cache_computed_blocks(request)
            if not request.prefilling:
                if len(request.output_ids) >= request.max_new_tokens:
                    updates.append(self._retire(request, {"type": "length", "length": request.max_new_tokens}))
                else:
                    updates.append(self._emit_token(request))
        return StepResult(duration, updates, len(decoding), prefill_tokens)

    def _emit_accepted_drafts(self, request: Request) -> RequestUpdate | None:
        """Speculative decoding: the draft tokens the target accepted this step, each with probability α
        until the first rejection (the verify step's own token is already out); the last update."""
        assert self.spec is not None
        update = None
        for _ in range(self.spec.draft_tokens):
            if request not in self.running or self._spec_rng.random() >= self.spec.acceptance:
                break
            if not self.cache.allocate(1):
                break  # no KV room for more: the rest of the accepted drafts are recomputed next step
            request.private += 1
            update = self._emit_token(request)
        return update

    def _reserve_decode_slots(self) -> list[Request]:
        """Give each decoding request room for one more token, retracting others when KV is full."""
        decoding = [r for r in self.running if not r.prefilling]
        for request in decoding:
            if request not in self.running:
                continue  # retracted earlier in this loop
            while not self.cache.allocate(1):
                victim = self._choose_victim()
                self._retract(victim)
                if victim is request:
                    break
            else:
                request.private += 1
        return [r for r in decoding if r in self.running]

    def _admit(self, updates: list[RequestUpdate]) -> None:
        if not self.waiting:
            return
        config = self.config
        self.waiting.sort(key=lambda r: (-r.priority, r.order))
        budget = config.chunked_prefill_size - sum(len(r.fill_ids) - r.computed for r in self.running if r.prefilling)
        adapters_in_batch = {r.lora_name for r in self.running}
        for request in list(self.waiting):
            if budget <= 0:
                break
            adapter_name = request.lora_name
            # An adapter unloaded (or evicted) since the request came keeps serving it: SGLang
            # frees the weights only after the requests that hold them finish.
            if request.lora is not None and request.lora.ready_at > self.now:
                continue  # still loading
            if adapter_name not in adapters_in_batch and len(adapters_in_batch) >= config.max_loras_per_batch:
                continue
            if (config.lora_overlap_loading and adapter_name is not None and adapter_name not in adapters_in_batch
                    and not self._overlap_copied(request, adapters_in_batch)):
                continue
            while len(self.running) >= config.max_running_requests:
                if not self._preempt_for(request):
                    return
            while not self._try_reserve_prompt(request):
                if not self._preempt_for(request):
                    return  # the head of the line waits for memory, as in SGLang
            self.waiting.remove(request)
            self.running.append(request)
            adapters_in_batch.add(adapter_name)
            if request.backed_up:
                self._restore(request)
            budget -= len(request.fill_ids) - request.computed

    def _try_reserve_prompt(self, request: Request) -> bool:
        """Match the prefix cache and check the rest of the prompt fits; locks the matched blocks."""
        bs = self.config.block_size
        # At least one token is always computed: its logits give the first output token.
        usable = min(len(request.hashes), (len(request.fill_ids) - 1) // bs) if self.config.prefix_cache else 0
        matched = self.cache.match(request.hashes[:usable])
        self.cache.lock(request.hashes[:matched])
        if self.cache.available_tokens() < self._prompt_room(request, matched * bs):
            self.cache.unlock(request.hashes[:matched])
            return False
        request.locked = matched
        request.computed = matched * bs
        if request.preemptions == 0:
            request.cached_tokens = matched * bs
            self.cached_tokens_total += matched * bs
        return True

    def _prompt_room(self, request: Request, cached: int) -> int:
        """KV tokens a waiting request needs free to be scheduled: the whole uncached prompt (as
        SGLang checks it, though it prefills a chunk at a time), the rest of the prompts being
        prefilled, and a share of every running request's remaining output."""
        needed = len(request.fill_ids) - cached + 1
        needed += sum(len(r.fill_ids) - r.computed for r in self.running if r.prefilling)
        needed += int(
            NEW_TOKEN_RATIO
            * sum(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATE) for r in (*self.running, request))
        )
        return needed

    def _plan_prefill(self) -> list[tuple[Request, int]]:
        budget = self.config.chunked_prefill_size
        chunks: list[tuple[Request, int]] = []
        for request in self.running:
            if budget <= 0:
                break
            if not request.prefilling:
                continue
            size = min(len(request.fill_ids) - request.computed, budget)
            completes = request.computed + size == len(request.fill_ids)
            # The token sampled at the end of the prompt needs a slot too.
            reserve = size + (1 if completes else 0)
            if not self.cache.allocate(reserve):
                break
            request.private += reserve
            chunks.append((request, size))
            budget -= size
        return chunks

    def _overlap_copied(self, request: Request, running: set[str | None]) -> bool:
        """--enable-lora-overlap-loading (SGLang's `LoRAOverlapLoader.try_overlap_load_lora`):
        whether the request's adapter is in a GPU slot, its copy done. One not there starts copying
        now if the batch's adapters, the copies under way and it fit the slots; either way the
        request waits for a later step."""
        name = request.lora_name
        assert name is not None
        for done in [n for n, ready in self.gpu_copies.items() if ready <= self.now]:
            del self.gpu_copies[done]  # drained: resident like any other
        if name in self.gpu_copies:
            return False  # still copying
        if name in self.gpu_slots.resident:
            return True
        wanted = running | set(self.gpu_copies) | {name}
        if len(wanted) > self.config.max_loras_per_batch:
            return False
        pinned = {n for n, adapter in self.adapters.items() if adapter.pinned}
        try:
            self.gpu_slots.prepare(wanted, pinned)
        except ValueError:
            return False  # every other slot pinned: it waits
        if self.config.lora_load_time_s is not None:
            return True  # copies are free with a fixed load time (tests): in its slot now
        rank = request.lora.rank if request.lora is not None else self.config.priced_lora_rank
        self.copy_stream_free_at = max(self.now, self.copy_stream_free_at) + self._copy_s(name, rank)
        self.gpu_copies[name] = self.copy_stream_free_at
        return False

    def _copy_s(self, name: str, rank: int) -> float:
        """One adapter's copy into a GPU slot. With overlap loading SGLang keeps the pinned host copy
        it made for the first one (lora_pool.py); without it every copy pins again."""
        adapter = self.adapters.get(name)
        if not self.config.lora_overlap_loading or adapter is None:
            return host_to_gpu_s(rank, pinned=False)
        seconds = host_to_gpu_s(rank, pinned=adapter.host_pinned)
        adapter.host_pinned = True
        return seconds

    def _copy_adapters_to_gpu(self, batch: set[str | None], requests: list[Request]) -> float:
        """Seconds the step waits for adapters copied into GPU slots (none with --lora-load-time,
        which stands for the whole load, and none with overlap loading, whose copies ran before)."""
        if batch == {None}:
            return 0.0
        pinned = {name for name, adapter in self.adapters.items() if adapter.pinned}
        try:  # copies under way keep their slots (SGLang excludes them from eviction)
            copied = set(self.gpu_slots.prepare(batch | set(self.gpu_copies), pinned)) - {None}
        except ValueError:  # the batch and the copies do not fit together: the batch's needs first
            copied = set(self.gpu_slots.prepare(batch, pinned)) - {None}
        if not copied or self.config.lora_load_time_s is not None:
            return 0.0
        ranks = {r.lora_name: r.lora.rank for r in requests if r.lora is not None}
        return sum(self._copy_s(name, ranks.get(name, self.config.priced_lora_rank)) for name in copied if name is not None)

    def _wait_for_adapters(self, updates: list[RequestUpdate]) -> StepResult:
        loading = [
            r.lora.ready_at for r in self.waiting if r.lora is not None and r.lora.ready_at > self.now
        ]
        if self.waiting:  # copies into GPU slots the waiting requests wait for
            loading += [ready for ready in self.gpu_copies.values() if ready > self.now]
        if loading:
            wait = min(loading) - self.now
            self.now += wait
            return StepResult(wait, updates)
        return StepResult(0.0, updates, idle=True)

    def _preempt_for(self, request: Request) -> bool:
        """Retract the least important running request if `request` outranks it by the threshold."""
        if not self.running:
            return False
        victim = self._choose_victim()
        if request.priority - victim.priority <= self.config.priority_preemption_threshold:
            return False
        self._retract(victim)
        return True

    def _choose_victim(self) -> Request:
        # Lowest priority first; among equals the newest, which has the least work to redo.
        return min(self.running, key=lambda r: (r.priority, -r.order))

    def _retract(self, request: Request) -> None:
        """Send a running request back to waiting; it will recompute prompt + output so far."""
        self.running.remove(request)
        self._free(request, cache_blocks=True)
        request.preemptions += 1
        self.preemptions_total += 1
        self._set_fill(request, request.input_ids + request.output_ids)
        request.backed_up = self.config.disaggregation_mode == "decode"
        self.waiting.append(request)

    def _restore(self, request: Request) -> None:
        """Copy a backed-up request's KV back from host memory (every GPU its share, over PCIe):
        it decodes again at once, the copy added to this step."""
        tokens = len(request.fill_ids) - request.computed
        if tokens > 0 and self.cache.allocate(tokens):
            request.private += tokens
            request.computed = len(request.fill_ids)
            self._restore_s += tokens * self._kv_bytes_per_token / (self.config.tp * HOST_TO_DEVICE_BANDWIDTH)
        request.backed_up = False

    # ------------------------------------------------------------------ tokens and finishing

    def _emit_token(self, request: Request, given: tuple[int, str] | None = None) -> RequestUpdate:
        # Each token is a function of the whole context, as with a real model: a prompt extended
        # by part of an output (a migrated request) continues with the rest of that output.
        # `given`: a token another engine sampled (a prefill engine's first token).
        mixed = (request.context_hash * 2654435761) & 0xFFFFFFFF
        script = request.script
        if given is not None:
            token_id, piece = given
        elif script is not None:
            token_id, piece = script[len(request.output_ids)]
        else:
            token_id, piece = self.vocabulary[(mixed >> 8) % len(self.vocabulary)]
        if request.return_logprob:
            _record_logprobs(request, mixed, piece, token_id, self.vocabulary)
        request.output_ids.append(token_id)
        request.context_hash = zlib.crc32(_TOKEN.pack(token_id), request.context_hash)
        self.generation_tokens_total += 1
        if request.first_token_time is None:
            request.first_token_time = self.now
        previous_len = len(request.text)
        request.text += piece
        finish = self._check_finished(request, token_id, previous_len)
        if finish is not None:
            return self._retire(request, finish)
        return RequestUpdate(request, request.text, len(request.output_ids), None)

    def _check_finished(self, request: Request, token_id: int, previous_len: int) -> dict[str, Any] | None:
        generated = len(request.output_ids)
        if request.script is not None and generated >= len(request.script):
            return {"type": "stop", "matched": self.eos_id}
        if generated >= request.max_new_tokens:
            return {"type": "length", "length": request.max_new_tokens}
        sampling = request.sampling
        if generated < sampling.min_new_tokens:
            return None
        if sampling.stop_token_ids and token_id in sampling.stop_token_ids:
            return {"type": "stop", "matched": token_id}
        if request.script is None and request.answer_length and generated >= request.answer_length:
            return {"type": "stop", "matched": self.eos_id}  # the model's EOS (not part of the text)
        if request.stops:
            text = request.text
            best: tuple[int, str] | None = None
            for stop in request.stops:
                index = text.find(stop, max(0, previous_len - len(stop) + 1))
                if index >= 0 and (best is None or index < best[0]):
                    best = (index, stop)
            if best is not None:
                if not sampling.no_stop_trim:
                    request.text = text[: best[0]]
                return {"type": "stop", "matched": best[1]}
        return None

    def _retire(self, request: Request, finish_reason: dict[str, Any]) -> RequestUpdate:
        self.running.remove(request)
        self._free(request, cache_blocks=True)
        return self._finish(request, finish_reason)

    def _finish(self, request: Request, finish_reason: dict[str, Any]) -> RequestUpdate:
        request.finish_reason = finish_reason
        request.finish_time = self.now
        del self._requests[request.rid]
        return RequestUpdate(request, request.text, len(request.output_ids), finish_reason)

    # ------------------------------------------------------------------ KV bookkeeping

    def _set_fill(self, request: Request, fill_ids: list[int]) -> None:
        request.fill_ids = fill_ids
        request.hashes = block_hashes(fill_ids, self.config.block_size, namespace=request.lora_name or "")
        request.computed = request.locked = request.private = 0

    def _cache_computed_blocks(self, request: Request) -> None:
        """Publish the prompt blocks prefilled so far (SGLang caches unfinished requests too)."""
        if not self.config.prefix_cache:
            return
        full = min(request.computed // self.config.block_size, len(request.hashes))
        if full <= request.locked:
            return
        self._move_to_cache(request, full, request.fill_ids, start=request.locked)
        self.cache.lock(request.hashes[request.locked : full])
        request.locked = full

    def _move_to_cache(self, request: Request, full: int, token_ids: list[int], start: int = 0) -> None:
        moved = (full - request.locked) * self.config.block_size
        self.cache.release(moved)
        request.private -= moved
        self.cache.insert(request.hashes[:full], token_ids, request.lora_name, start=start)

    def _free(self, request: Request, cache_blocks: bool) -> None:
        """Release a request's KV; its computed full blocks stay behind in the prefix cache."""
        bs = self.config.block_size
        if cache_blocks and self.config.prefix_cache:
            if request.prefilling:
                kv_len = request.computed
                sequence = request.fill_ids
            else:
                # The last sampled token has no KV yet.
                sequence = request.input_ids + request.output_ids
                kv_len = len(sequence) - 1
            full = kv_len // bs
            if full > len(request.hashes):
                request.hashes = block_hashes(sequence[: full * bs], bs, namespace=request.lora_name or "")
            full = min(full, request.private // bs + request.locked)
            if full > request.locked:
                self._move_to_cache(request, full, sequence)
        self.cache.release(request.private)
        self.cache.unlock(request.hashes[: request.locked])
        request.private = request.locked = 0


_TOKEN = struct.Struct("<I")


def _record_logprobs(request: Request, mixed: int, piece: str, token_id: int,
                     vocabulary: tuple[tuple[int, str], ...]) -> None:
    """Plausible logprobs, a function of the context: the emitted token is the most likely one
    (from about -0.01 to -2.5) and the alternatives, tokens of the output vocabulary, fall off
    behind it."""
    logprob = -0.01 - ((mixed >> 4) % 250) / 100
    request.token_logprobs.append((logprob, token_id, piece))
    top: list[tuple[float, int, str]] = []
    if request.top_logprobs_num:
        top.append((logprob, token_id, piece))
        distinct = len({text for _, text in vocabulary} | {piece})
        step = 0
        while len(top) < min(request.top_logprobs_num, distinct):
            step += 1
            other_id, other = vocabulary[(mixed + step * 7919) % len(vocabulary)]
            if any(other == t[2] for t in top):
                continue
            top.append((logprob - 0.5 * step - ((mixed >> step) % 50) / 100, other_id, other))
    request.top_logprobs.append(top)


def _context_hash(request: Request) -> int:
    """Greedy output depends on the context and the adapter (its weights change the model);
    sampled output also on the seed (or the rid)."""
    salt = zlib.crc32(request.lora_name.encode()) if request.lora_name else 0
    if request.sampling.temperature != 0.0:
        seed = request.sampling.sampling_seed if request.sampling.sampling_seed is not None else request.rid
        salt = zlib.crc32(str(seed).encode(), salt)
    # crc32 is incremental: hashing the prompt then each output id equals hashing them all at once.
    return zlib.crc32(array("I", request.input_ids).tobytes(), salt)


def new_rid() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------- closed-loop driver


@dataclass(frozen=True, slots=True)
class ClosedLoopStats:
    concurrency: int
    completed: int  # requests measured (after warm-up)
    duration_s: float  # virtual seconds of the measurement window
    output_tokens_per_s: float
    mean_ttft_s: float
    mean_itl_s: float  # per request (e2e − TTFT) / (output − 1), then averaged, as genai-perf does
    mean_e2e_s: float
    steps: int
    preemptions: int


def simulate_closed_loop(
    config: EngineConfig,
    concurrency: int,
    input_len: int,
    output_len: int,
    n_requests: int | None = None,
    duration_s: float | None = None,
    *,
    warmup_requests: int | None = None,
    step_model: StepTimeModel | None = None,
    seed: int = 0,
) -> ClosedLoopStats:
    """`concurrency` clients each send a new request as soon as the last finishes, in virtual time.

    Prompts are `input_len` random tokens, distinct per request from the first block on, so the
    prefix cache never helps; output is exactly `output_len` tokens. The first `warmup_requests`
    completions (default: one per client) are left out, as is the time before the last of them.
    Stops after `n_requests` measured completions or `duration_s` virtual seconds.
    """
    if n_requests is None and duration_s is None:
        raise ValueError("give n_requests or duration_s")
    warmup = concurrency if warmup_requests is None else warmup_requests
    engine = Engine(config, step_model)
    rng = random.Random(seed)
    body = [rng.randrange(VOCAB_SIZE) for _ in range(input_len)]
    sampling = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        prompt = list(body)
        prompt[0] = submitted % VOCAB_SIZE
        if input_len > 1:
            prompt[1] = submitted // VOCAB_SIZE
        engine.add(Request(rid=f"closed-loop-{submitted}", input_ids=prompt, sampling=sampling))
        submitted += 1

    for _ in range(concurrency):
        submit()
    done = 0
    window_start: float | None = None if warmup else 0.0
    tokens_at_start = 0
    measured: list[Request] = []
    steps = 0
    while True:
        result = engine.step()
        steps += 1
        if result.idle:
            raise RuntimeError("closed-loop simulation stalled: nothing can run")
        finished = [u.request for u in result.updates if u.finish_reason is not None]
        for request in finished:
            done += 1
            if done > warmup:
                measured.append(request)
            elif done == warmup:
                window_start = engine.now
                tokens_at_start = engine.generation_tokens_total
        if n_requests is not None and len(measured) >= n_requests:
            break
        if duration_s is not None and engine.now >= duration_s:
            break
        for _ in finished:
            submit()

    start = window_start if window_start is not None else 0.0
    window = engine.now - start
    ttfts = [r.first_token_time - r.arrival_time for r in measured if r.first_token_time is not None]
    itls = [
        (r.finish_time - r.first_token_time) / (len(r.output_ids) - 1)
        for r in measured
        if r.first_token_time is not None and r.finish_time is not None and len(r.output_ids) > 1
    ]
    e2es = [r.finish_time - r.arrival_time for r in measured if r.finish_time is not None]
    return ClosedLoopStats(
        concurrency=concurrency,
        completed=len(measured),
        duration_s=window,
        output_tokens_per_s=(engine.generation_tokens_total - tokens_at_start) / window if window > 0 else 0.0,
        mean_ttft_s=_mean(ttfts),
        mean_itl_s=_mean(itls),
        mean_e2e_s=_mean(e2es),
        steps=steps,
        preemptions=engine.preemptions_total,
    )


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
