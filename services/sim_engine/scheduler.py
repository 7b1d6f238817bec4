"""The simulated engine's scheduler: continuous batching over a virtual clock.

Pure: no asyncio, no I/O. Time is virtual and moves only with `Engine.step()` (by the step time
the perf model prices) and `Engine.advance()` (idle time the caller observed); the HTTP shell maps
it to wall time with `time_scale`, the closed-loop driver (`closed_loop.py`) never sleeps at all.

Behaviour follows SGLang's scheduler where it is observable from the outside: chunked prefill
under a token budget, prefix-cache hits skipping prefill (reported as `cached_tokens`), requests
waiting while the KV pool is full and running ones retracted (recomputed later) when it
overflows (how much room and which victim: `admission.py`), priority (larger is more important;
ignored unless `priority_scheduling`, as SGLang's --enable-priority-scheduling), LoRA slots per
batch, and SGLang's error messages. What the model outputs and when a request finishes are
`output.py`'s; the request and its reports are `request.py`'s, its sampling params `sampling.py`'s.
"""


from __future__ import annotations

import random
from typing import Any

from inferbus.timing import LORA_LOAD_BANDWIDTH, FixedStepModel, SpecDecoding, StepTimeModel, roofline
from inferbus.tokens.blocks import block_hashes

from .admission import choose_victim, prompt_room
from .config import EngineConfig
from .lora_pool import GpuSlots, LoadedAdapters, LoraAdapter, adapter_rank, disk_load_s, host_to_gpu_s, lora_path_exists
from .output import (
    STANDIN_VOCABULARY,
    OutputVocabulary,
    answer_length,
    check_finished,
    context_hash,
    extend_context_hash,
    record_logprobs,
)
from .profile_table import TableStepModel, load_npz
from .radix_cache import RadixCache
from .request import LoadSnapshot, LoraUpdateResult, Request, RequestRejected, RequestUpdate, StepResult

# Host memory to GPU over PCIe Gen5 x16, achieved (the planner's adapter-load rate, inferbus/timing.py).
HOST_TO_DEVICE_BANDWIDTH = LORA_LOAD_BANDWIDTH


class Engine:
    def __init__(self, config: EngineConfig, step_model: StepTimeModel | None = None,
                 vocabulary: OutputVocabulary = STANDIN_VOCABULARY) -> None:
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
        request.context_hash = context_hash(request)
        request.answer_length = answer_length(request, self.config.answer_length_median)
        request.arrival_time = self.now
        request.order = self._next_order
        self._next_order += 1
        self._set_fill(request, request.input_ids)
        self.prompt_tokens_total += prompt_len
        self._requests[request.rid] = request
        (self.held if held else self.waiting).append(request)

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
                victim = choose_victim(self.running)
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
        """KV tokens a waiting request needs free to be scheduled (`admission.prompt_room`); a
        subclass may count otherwise (bench/simulate_vs_dynamo.py's Dynamo mocker quirks)."""
        return prompt_room(request, cached, self.running)

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
        default_rank = self.config.priced_lora_rank
        return sum(self._copy_s(name, ranks.get(name, default_rank)) for name in copied if name is not None)

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
        victim = choose_victim(self.running)
        if request.priority - victim.priority <= self.config.priority_preemption_threshold:
            return False
        self._retract(victim)
        return True

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
            record_logprobs(request, mixed, piece, token_id, self.vocabulary)
        request.output_ids.append(token_id)
        request.context_hash = extend_context_hash(request.context_hash, token_id)
        self.generation_tokens_total += 1
        if request.first_token_time is None:
            request.first_token_time = self.now
        previous_len = len(request.text)
        request.text += piece
        finish, request.text = check_finished(request, token_id, previous_len, self.eos_id)
        if finish is not None:
            return self._retire(request, finish)
        return RequestUpdate(request, request.text, len(request.output_ids), None)

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
