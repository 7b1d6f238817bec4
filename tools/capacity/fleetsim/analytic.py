"""An analytic engine replica: a few O(1) events per request instead of one event per GPU step.

The per-step simulator (`fleet.FleetSim`) runs the engine's scheduler for every iteration; this
model keeps only what decides the timing and advances over runs of identical steps at once:

- Steps are counted by `D`. A run of steps ("segment") has a constant shape (decode batch B, a
  full chunk of prefill or the queue's last partial chunk) and hence one step time `tau`, from
  the same `StepTimeModel` the engine uses, priced at the segment's mean resident context (the
  step time is linear in S, and S grows by B tokens a step, so that is exact in sum).
- Prefill is a FIFO of uncached prompt tokens processed `chunk` tokens a step (SGLang chunked
  prefill: one step may finish several short prompts). A prompt's first token comes at the end
  of the step that computes its last token.
- A sequence whose prefill ended after step `Dp` with `out` output tokens emits one token each
  following step and finishes after step `Dp + out - 1` (a heap per replica). Resident context
  S = C + B·D with C = Σ(input + 1 - Dp) kept in O(1).
- A segment ends at the earliest change: a decode finish, the head prompt's last step, or the
  switch from full chunks to the queue's partial last chunk. A request arriving mid-segment joins
  at the next step boundary (as in the engine): the segment is cut there (`sync`).
- Mixed steps or not (`mixed`): with SGLang's `--enable-mixed-chunk` (the default here) a step
  that prefills also decodes every running sequence. Without it (SGLang's own default, and
  Dynamo's mocker in SGLang mode) a step prefills when there is prompt work and decodes only
  when there is none; `D` then counts decode steps only, so a prefill run does not advance the
  sequences waiting to decode.
- Prefix cache (optional, `prefix_block_tokens`): for requests that carry prefix block ids (a
  Mooncake trace's `hash_ids`, one per `prefix_block_tokens` tokens), an LRU of those blocks,
  each with how many of its tokens are cached in whole engine pages, holding at most the KV pool
  (beyond it the least recent block gives up its last pages, as many as needed: the engine evicts
  pages, not trace blocks).
  A request's leading cached blocks are its hit (at least one prompt token is still computed) and
  its blocks become the most recent, when it is scheduled (as the engine matches its prefix) and
  again when it finishes (as the engine inserts the finished sequence).
  While requests in the batch share blocks, the KV pool holds them once: a request is charged
  only for the blocks no other request in the batch holds. Without ids, a request's cached
  tokens are what it arrived with (the mix's statistic).
- Admission (SGLang's): a request is scheduled into prefill while the step's prefill budget has
  room (less than a chunk of scheduled prompt left), fewer than `max_running` requests run and its
  prompt, plus `NEW_TOKEN_RATIO` of every running request's remaining output, fits in free KV;
  otherwise it waits in FIFO order (head-of-line). Retraction (recompute after KV overflow) is
  not modelled: the reservation makes it rare, and resident KV may then exceed capacity.

Pure: no clock, no I/O; a finished request is reported through the `on_finish` callback (its
`first` and `start` times are set on it).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable

from inferbus.timing import (
    ETA_GEMM,
    ETA_KV,
    ETA_WEIGHTS,
    PREFILL_ATTENTION_EFFICIENCY,
    RooflineModel,
    StepTimeModel,
)
from services.sim_engine.admission import CLIP_MAX_NEW_TOKENS_ESTIMATE, NEW_TOKEN_RATIO


class Req:
    """One request as the fleet and a replica see it (times in virtual seconds)."""

    __slots__ = ("arrival", "input", "output", "cached", "remaining", "start", "first", "finish", "replica", "band",
                 "blocks")

    def __init__(self, arrival: float, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
                 blocks: tuple[int, ...] | None = None) -> None:
        self.arrival = arrival
        self.input = input_tokens
        self.output = output_tokens if output_tokens > 1 else 1
        self.blocks = blocks  # prefix block ids (a replica with a prefix cache looks them up)
        self.set_cached(cached_tokens)
        self.start: float = -1.0  # prefill began (queue wait = start - arrival)
        self.first: float = -1.0  # first token
        self.finish: float = -1.0  # last token (set by the fleet)
        self.replica: AnalyticReplica | None = None
        self.band = "standard"

    def set_cached(self, cached_tokens: int) -> None:
        # At least one prompt token is computed (its logits give the first output token).
        cached = cached_tokens if cached_tokens < self.input - 1 else self.input - 1
        self.cached = cached = cached if cached > 0 else 0
        self.remaining = self.input - cached  # uncached prompt tokens still to prefill


Callback = Callable[[Req, float], None]
_INF = float("inf")
_heappush, _heappop = heapq.heappush, heapq.heappop


class AnalyticReplica:
    __slots__ = (
        "name", "model", "step_time", "chunk", "max_running", "kv_capacity", "on_finish",
        "t", "D", "n", "tau", "full", "end", "version",
        "decoding", "B", "C", "sum_dfin", "prefill", "Q", "prefill_kv", "prefill_out", "waiting",
        "seq", "completed", "taken", "busy_s", "prefilled_tokens", "draining",
        "mixed", "page", "prefix_block", "prefix_cache", "prefix_tokens", "prompt_tokens", "cached_tokens",
        "output_tokens", "cache_log", "stored_blocks", "evicted_blocks", "held", "held_tokens",
        "shared_kv",
    )

    def __init__(
        self,
        name: str,
        model: StepTimeModel,
        *,
        kv_capacity: int,
        chunk: int = 512,
        max_running: int = 256,
        on_finish: Callback | None = None,
        mixed: bool = True,
        prefix_block_tokens: int = 0,
        page_tokens: int = 1,
    ) -> None:
        self.name = name
        self.model = model
        # With speculative decoding a step gives each decoding sequence E tokens, while this replica
        # counts one token a step: its step is 1/E of the engine's, prefilling 1/E of the chunk.
        per_step = float(getattr(model, "tokens_per_step", 1.0))  # a profile table has none: 1
        self.chunk = chunk if per_step == 1.0 else max(1, round(chunk / per_step))
        self.step_time = step_function(model, chunk / self.chunk)
        self.max_running = max_running
        self.kv_capacity = kv_capacity
        self.on_finish: Callback = on_finish or _ignore
        self.t = 0.0  # start of the current segment (a step boundary)
        self.D = 0  # steps completed at `t`
        self.n = 0  # steps in the current segment (0: idle)
        self.tau = 0.0
        self.full = False  # prefill steps of a full chunk (else: the queue's partial last chunk)
        self.end = float("inf")  # when the current segment ends
        self.version = 0  # bumped on every re-plan: the fleet's queued events for older ones are stale
        self.decoding: list[tuple[int, int, Req]] = []  # (step after which it finishes, seq, request)
        self.B = 0
        self.C = 0  # Σ (input + 1 - step its decode started)
        self.sum_dfin = 0
        self.prefill: deque[Req] = deque()
        self.Q = 0  # uncached prompt tokens queued for prefill
        self.prefill_kv = 0  # KV reserved for prompts being prefilled
        self.prefill_out = 0  # their output tokens (admission reserves a share of them)
        self.waiting: deque[Req] = deque()
        self.seq = 0
        self.completed = 0
        self.taken = 0  # requests placed on it and taken (the worker's pulled_own; counted by the fleet)
        self.busy_s = 0.0  # time spent in steps
        self.draining = False  # set by the fleet: takes no new work, stops once empty
        self.prefilled_tokens = 0
        self.mixed = mixed  # a prefill step also decodes (else a step prefills or decodes)
        self.page = page_tokens if page_tokens > 0 else 1  # the engine's KV page: the unit cached
        self.prefix_block = prefix_block_tokens  # tokens per prefix block id; 0: no prefix cache
        self.prefix_cache: OrderedDict[int, int] = OrderedDict()  # block id → its tokens cached, LRU first
        self.prefix_tokens = 0  # Σ of the cache's tokens
        # With `cache_log` (the router sees the cache, as from an engine's KV events), the block ids
        # the prefix cache took in and evicted since the fleet last drained these lists.
        self.cache_log = False
        self.stored_blocks: list[int] = []
        self.evicted_blocks: list[int] = []
        # Prefix blocks held by requests in the batch (block id → how many hold it), and the KV that
        # sharing saves: a prefix several running requests share is in the pool once, as in the engine.
        self.held: dict[int, int] = {}
        self.held_tokens = 0  # Σ of the held blocks' tokens (each once)
        self.shared_kv = 0
        self.prompt_tokens = 0  # of the requests it took, and of those the cached, and their output
        self.cached_tokens = 0
        self.output_tokens = 0

    # ---- what the worker reports -------------------------------------------------------------

    @property
    def running(self) -> int:
        return self.B + len(self.prefill)

    @property
    def in_flight(self) -> int:
        return self.B + len(self.prefill) + len(self.waiting)

    def kv_used(self) -> int:
        return self.C + self.B * self.D + self.prefill_kv - self.shared_kv

    def queued_prefill(self) -> int:
        return self.Q + sum(r.remaining for r in self.waiting)

    @property
    def idle(self) -> bool:
        return self.n == 0

    # ---- driving it ----------------------------------------------------------------------------

    def add(self, req: Req, now: float) -> float:
        """A request arrives at `now`; returns when the replica's next segment ends (inf: idle)."""
        if self.n:
            # `sync(now)`, inlined (once per request).
            t = self.t
            if now > t:
                tau = self.tau
                done = int((now - t) / tau)
                if t + done * tau < now:
                    done += 1
                if done > self.n:
                    done = self.n
                self._advance(done)
                if self.waiting:
                    self._admit_waiting()
        elif now > self.t:
            self.t = now
        req.replica = self
        self.prompt_tokens += req.input
        if not self.prefix_block or req.blocks is None:
            self.cached_tokens += req.cached  # its hit came with it; a prefix hit is looked up on admission
        self.output_tokens += req.output
        if self.waiting or not self._admit(req):
            self.waiting.append(req)
        return self._plan()

    def segment_end(self) -> float:
        """The fleet's event for the current segment fired: apply it; returns the next end."""
        self._advance(self.n)
        if self.waiting:
            self._admit_waiting()
        return self._plan()

    def run_until(self, now: float) -> None:
        """Apply every segment that ends at or before `now`: `segment_end()` while `end <= now`
        (the fleet's lazy catch-up; one loop here instead of a call per segment)."""
        advance, plan = self._advance, self._plan
        while self.end <= now:
            advance(self.n)
            if self.waiting:
                self._admit_waiting()
            plan()

    def sync(self, now: float) -> None:
        """Bring the replica to the first step boundary at or after `now` (a request joins there)."""
        if self.n == 0:
            if now > self.t:
                self.t = now
            return
        elapsed = now - self.t
        if elapsed <= 0.0:
            return
        done = int(elapsed / self.tau)
        if self.t + done * self.tau < now:
            done += 1
        if done > self.n:
            done = self.n
        self._advance(done)
        if self.waiting:
            self._admit_waiting()
        self.version += 1  # the old segment's end event is stale; the caller re-plans

    # ---- internals -----------------------------------------------------------------------------

    def _prefix_hit(self, req: Req) -> int:
        """Prompt tokens of `req` in the prefix cache (its leading cached blocks); its blocks are
        then the most recent, its first block the most recent of all, so that a prefix loses its
        last blocks first (as the engine's radix cache evicts leaves), and the least recent are
        evicted beyond the room the batch leaves."""
        cache = self.prefix_cache
        block, page = self.prefix_block, self.page
        left = req.input
        hit = 0
        alive = True
        tokens = self.prefix_tokens
        for block_id in req.blocks or ():
            size = block if left > block else left
            left -= size
            full = size - size % page  # only whole pages are cached
            held = cache.get(block_id)
            if held is None:
                alive = False
                if full:
                    cache[block_id] = full
                    tokens += full
                    if self.cache_log:
                        self.stored_blocks.append(block_id)
                continue
            if alive:
                hit += held if held < full else full
                if held < full:
                    alive = False
            if full > held:
                cache[block_id] = full
                tokens += full - held
        for block_id in reversed(req.blocks or ()):
            if block_id in cache:
                cache.move_to_end(block_id)
        # The cache has the pool less what the batch holds outside it (its output, its prompts'
        # partial pages), and never gives up a block the batch holds (the engine's are locked).
        # The engine evicts pages, not blocks: the least recent block gives up only as many of its
        # last pages as the pool needs, and stays the least recent with the rest.
        capacity = self.kv_capacity - (self.kv_used() - self.held_tokens)
        in_batch = self.held
        skipped = 0
        while tokens > capacity and len(cache) > skipped:
            evicted_id, cached = cache.popitem(last=False)
            if evicted_id in in_batch:
                cache[evicted_id] = cached  # in use: now the most recent
                skipped += 1
                continue
            excess = tokens - capacity
            pages = (excess + page - 1) // page * page
            if pages < cached:
                cache[evicted_id] = cached - pages
                cache.move_to_end(evicted_id, last=False)
                tokens -= pages
                break
            tokens -= cached
            if self.cache_log:
                self.evicted_blocks.append(evicted_id)
        self.prefix_tokens = tokens
        return hit

    def _touch(self, req: Req) -> None:
        """A finished request's cached blocks become the most recent (the engine inserts the
        finished sequence into its radix cache, which touches its nodes)."""
        cache = self.prefix_cache
        for block_id in reversed(req.blocks or ()):
            if block_id in cache:
                cache.move_to_end(block_id)

    def _hold(self, req: Req, delta: int) -> int:
        """`req`'s prompt blocks (whole pages of them) taken into the batch (`delta` 1), let go (-1)
        or only looked at (0); returns the tokens of them that another request in the batch holds
        too, which the KV pool holds once."""
        held = self.held
        block, page = self.prefix_block, self.page
        left = req.input
        shared = 0
        for block_id in req.blocks or ():
            size = block if left > block else left
            left -= size
            full = size - size % page
            if not full:
                continue
            count = held.get(block_id, 0)
            if delta == 0 and not count:
                break  # block ids are chained (a trace's hash ids): none after this one is held either
            if delta > 0:
                held[block_id] = count + 1
                if not count:
                    self.held_tokens += full
            elif delta < 0:
                if count <= 1:
                    if held.pop(block_id, None) is not None:
                        self.held_tokens -= full
                    continue
                held[block_id] = count - 1
                count -= 1
            if count:
                shared += full
        return shared

    def _admit(self, req: Req) -> bool:
        # The engine schedules a waiting prompt only while the step's prefill budget has room
        # (prompts already scheduled leave less than a chunk to prefill), so the rest wait
        # unscheduled: no KV held, prefix not yet matched.
        if self.Q >= self.chunk or self.B + len(self.prefill) >= self.max_running:
            return False
        out = req.output if req.output < CLIP_MAX_NEW_TOKENS_ESTIMATE else CLIP_MAX_NEW_TOKENS_ESTIMATE
        remaining_out = self.sum_dfin - self.B * self.D + self.prefill_out + out
        sharing = self.prefix_block and req.blocks is not None
        shared = self._hold(req, 0) if sharing else 0
        needed = req.input + 1 - shared + int(NEW_TOKEN_RATIO * remaining_out)
        used = self.C + self.B * self.D + self.prefill_kv - self.shared_kv
        if used + needed > self.kv_capacity and (self.B or self.prefill):
            return False  # an empty replica takes anything that fits at all (the engine rejects larger)
        if not self.prefill:
            req.start = self.t
        if sharing:
            # As the engine: the prefix is matched when the request is scheduled, not when it queues.
            req.set_cached(self._prefix_hit(req))
            self.cached_tokens += req.cached
            self.shared_kv += self._hold(req, 1)
        self.prefill.append(req)
        self.Q += req.remaining
        self.prefill_kv += req.input + 1
        self.prefill_out += out
        return True

    def _admit_waiting(self) -> None:
        waiting = self.waiting
        while waiting and self._admit(waiting[0]):
            waiting.popleft()

    def _advance(self, steps: int) -> None:
        """Apply `steps` steps of the current segment (at most all of them)."""
        # Hot (a few calls per request): counters are kept in locals and written back once.
        if steps <= 0:
            return
        t0 = self.t
        tau = self.tau
        busy = steps * tau
        self.t = t = t0 + busy
        Q = self.Q
        # Without mixed steps a prefill run decodes nothing: D counts decode steps only.
        self.D = D = self.D + steps if self.mixed or not Q else self.D
        self.busy_s += busy
        decoding = self.decoding
        if Q:
            consumed = steps * self.chunk if self.full else Q
            self.Q = Q - consumed
            self.prefilled_tokens += consumed
            prefill = self.prefill
            if prefill and consumed >= prefill[0].remaining:
                on_finish = self.on_finish
                B, C, sum_dfin, seq = self.B, self.C, self.sum_dfin, self.seq
                prefill_kv, prefill_out = self.prefill_kv, self.prefill_out
                while prefill and consumed >= prefill[0].remaining:
                    req = prefill.popleft()
                    consumed -= req.remaining
                    req.remaining = 0
                    if req.start < 0.0:
                        req.start = t - tau
                    req.first = t
                    output = req.output
                    prefill_kv -= req.input + 1
                    prefill_out -= output if output < CLIP_MAX_NEW_TOKENS_ESTIMATE else CLIP_MAX_NEW_TOKENS_ESTIMATE
                    if output <= 1:
                        if req.blocks is not None and self.prefix_block:
                            self.shared_kv -= self._hold(req, -1)
                            self._touch(req)
                        self.completed += 1
                        self.B, self.C, self.sum_dfin, self.seq = B, C, sum_dfin, seq  # the callback may look
                        self.prefill_kv, self.prefill_out = prefill_kv, prefill_out
                        on_finish(req, t)
                        continue
                    dfin = D + output - 1
                    seq += 1
                    _heappush(decoding, (dfin, seq, req))
                    B += 1
                    C += req.input + 1 - D
                    sum_dfin += dfin
                self.B, self.C, self.sum_dfin, self.seq = B, C, sum_dfin, seq
                self.prefill_kv, self.prefill_out = prefill_kv, prefill_out
            if prefill:
                head = prefill[0]
                head.remaining -= consumed
                if head.start < 0.0:
                    head.start = t if consumed == 0 else t0
        if decoding and decoding[0][0] <= D:
            on_finish = self.on_finish
            B, C, sum_dfin, completed = self.B, self.C, self.sum_dfin, self.completed
            while decoding and decoding[0][0] <= D:
                dfin, _, req = _heappop(decoding)
                B -= 1
                C -= req.input + 1 - (dfin - req.output + 1)
                sum_dfin -= dfin
                completed += 1
                if req.blocks is not None and self.prefix_block:
                    self.shared_kv -= self._hold(req, -1)
                    self._touch(req)
                # Written back before the callback: the fleet may look at the replica from it.
                self.B, self.C, self.sum_dfin, self.completed = B, C, sum_dfin, completed
                on_finish(req, t)

    def _plan(self) -> float:
        """Choose the next segment from the current state (at a step boundary)."""
        self.version += 1
        B = self.B
        Q = self.Q
        if Q:
            chunk = self.chunk
            prefill = self.prefill
            head = prefill[0]
            position = head.input - head.remaining  # the head's next prompt token
            if Q <= chunk:
                # One step finishes every queued prompt; each chunk attends to its start plus half.
                n, self.full = 1, False
                n_p = Q
                if len(prefill) == 1:
                    ctx = position + n_p / 2
                else:
                    ctx = sum(r.remaining * (r.input - r.remaining / 2) for r in prefill) / n_p
            else:
                k = -(-head.remaining // chunk)
                n = k if Q - (k - 1) * chunk >= chunk else k - 1
                if B and self.mixed:
                    to_finish = self.decoding[0][0] - self.D
                    if to_finish < n:
                        n = to_finish
                self.full = True
                n_p, ctx = chunk, position + n * chunk / 2
            if not self.mixed:  # a prefill-only step
                tau = self.step_time(0, 0.0, n_p, ctx)
            else:
                if n == 1 or not B:
                    resident = float(self.C + B * self.D)
                else:
                    resident = self.C + B * (self.D + (n - 1) / 2)
                tau = self.step_time(B, resident, n_p, ctx)
        elif B:
            D = self.D
            n = self.decoding[0][0] - D
            tau = self.step_time(B, self.C + B * (D + (n - 1) / 2), 0, 0.0)
        else:
            self.n = 0
            self.end = _INF
            return _INF
        self.n = n
        if tau < 1e-12:
            tau = 1e-12
        self.tau = tau
        self.end = end = self.t + n * tau
        return end


def _ignore(req: Req, t: float) -> None:
    return None


StepFn = Callable[[int, float, int, float], float]


def step_function(model: StepTimeModel, prefill_scale: float = 1.0) -> StepFn:
    """`model.step_time` as a plain function; for the roofline, the same formula with its
    constants folded (the simulator calls it once per segment; `RooflineModel.step_time`
    recomputes them on every call).

    With speculative decoding (`model.tokens_per_step` E > 1) a replica's step is 1/E of an engine
    step: every decoding sequence gains one token and the step prefills 1/E of the engine's chunk,
    so it costs the engine step, with its prefill scaled back by `prefill_scale` (≈ E), over E."""
    per_step = float(getattr(model, "tokens_per_step", 1.0))
    if per_step != 1.0:
        engine_step = model.step_time

        def speculative_step(batch: int, resident: float, prefill: int = 0, ctx: float = 0.0) -> float:
            return engine_step(batch, resident, prefill * prefill_scale, ctx) / per_step  # type: ignore[arg-type]

        return speculative_step
    # LoRA (and any other model) adds terms the folded formula leaves out: use the model's own.
    if not isinstance(model, RooflineModel) or model.spec is not None or model.lora_rank > 0:
        return model.step_time  # type: ignore[return-value]  # (int, int, int, float) takes ints where floats are
    gpu, tp, spec = model.gpu, model.tp, model.model
    t_weights = spec.weight_bytes / (tp * gpu.hbm_bandwidth * ETA_WEIGHTS)
    gemm_per_token = 2 * spec.params / (tp * model.gemm_flops * ETA_GEMM)
    kv_per_token = spec.kv_bytes_per_token / (tp * gpu.hbm_bandwidth * ETA_KV)
    attention = 2 * spec.layers * spec.d_model / (tp * gpu.bf16_flops * PREFILL_ATTENTION_EFFICIENCY)
    base, gamma, c_seq = model.base_step_s, model.preset.gamma, model.preset.c_seq_s

    def step_time(batch: int, resident: float, prefill: int = 0, ctx: float = 0.0) -> float:
        t_gemm = gemm_per_token * (batch + prefill)
        if t_gemm > t_weights:
            overlap = t_gemm + gamma * t_weights
        else:
            overlap = t_weights + gamma * t_gemm
        return base + overlap + kv_per_token * resident + attention * prefill * ctx + c_seq * batch

    return step_time
