"""What the simulated engine keeps per request, and what it reports back: a step's result, a
request's update, an adapter load's answer, the load snapshot."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .lora_pool import LoraAdapter
from .sampling import SamplingParams


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



def new_rid() -> str:
    return uuid.uuid4().hex
