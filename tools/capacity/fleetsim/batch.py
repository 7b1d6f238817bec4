"""The batch band in the per-step fleet simulator: a large batch fed on spare capacity.

What runs is the production code again: the batch service's `services.batch.feed.FeedPolicy`
decides how many lines may be published, from the same `WorkerLoad` reports it gets on the bus
(interactive-only TTFT / queue-wait / TPOT histograms, `batch_in_flight`, engine queue and KV),
and each replica's worker uses `services.worker.preemption.PreemptionPolicy` to decide how many
batch lines it pulls (`pull_room`) and which running ones it preempts for waiting interactive
work (`victims`). Modelled simply, as the rest of `fleet`:

- The batch service publishes lines (in input order) onto one shared batch queue every
  `feed_interval_s`, as many as `allowance(outstanding)` grants, `outstanding` being lines
  published without a result (queued or running).
- A replica pulls batch lines at the end of each engine step, after interactive work, as many as
  `pull_room(...)` grants (at most one pull's fair share of its slots, as `SlotBudget` gives a
  pull request; with `batch_prefilling` = its lines without a first token, so one line is in
  prefill at a time, and the step-time cap of its engine's GPU and TP), and none while its last
  check saw interactive work waiting on the bus (or, with engines without priority scheduling,
  stalled in its engine): `pull_room`, as the worker asks it; an idle replica pulls when lines
  are published. Batch lines enter the engine at
  `proto.bands.ENGINE_PRIORITY["batch"]`, so an engine with priority scheduling (`EngineConfig.priority_scheduling`,
  on by default, as SGLang's --enable-priority-scheduling) admits waiting interactive requests
  first and retracts batch first when slots or KV run out.
- On each load report (the worker's load tick) a replica runs the worker's preemption check,
  `PreemptionPolicy.check`: interactive work queued for it (past its slots, or on the shared
  queue) when fewer than `headroom` slots are free, or, without engine priority, stalled in its
  engine (no first token after `engine_wait_s`), names the lines to abort; they are aborted at
  the end of the engine's current step (where an engine applies an abort), and each goes back to
  the end of the batch queue as its next attempt (`services.worker.attempt.attempt_verdict`), its
  prompt extended by the tokens generated so far and its budget reduced by them
  (`inferbus.tokens.continuation.engine_input`). The engine's tokens are a function of the context, so
  the resumed attempt continues the same output. An abort the engine makes on its own is retried
  as the worker retries it, up to the policy's `max_attempts`.
- A line reports exactly one result, when its last attempt finishes; a replica declared dead
  has its lines requeued the same way (the batch service re-publishes lines of a dead owner).
- Replicas build their `WorkerLoad` as the worker does: `in_flight` and `batch_in_flight` count
  batch lines, `batch_waiting` those without a first token, the TTFT / queue-wait / TPOT histograms count
  interactive first attempts only.

`BatchSpec.fixed_concurrency` replaces both policies with an oracle baseline for the benchmark:
every replica keeps exactly that many batch lines (the queue never runs dry), nothing is
preempted by the worker (the engine still retracts batch for KV).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from inferbus.tokens import continuation
from proto import bands
from proto import messages as m
from services.sim_engine.request import Request, RequestRejected, RequestUpdate
from services.sim_engine.sampling import SamplingParams
from services.worker.attempt import attempt_verdict
from services.worker.preemption import Check, WorkerState
from tools.capacity import mix as mix_mod
from tools.capacity.fleetsim.events import EventLoop
from tools.capacity.fleetsim.state import FleetConfig, Replica
from tools.capacity.fleetsim.workload import PromptTokens
from tools.capacity.mix import Mix
from tools.capacity.stats import percentile
from tools.capacity.traces import TraceRequest


class Fleet(Protocol):
    """What the batch band reads of the fleet it runs in (`fleet.FleetSim`), and asks of it."""

    config: FleetConfig
    loop: EventLoop
    prompts: PromptTokens
    done: bool

    @property
    def replicas(self) -> Sequence[Replica]: ...

    def step(self, replica: Replica) -> None:
        """Step `replica`'s engine (it is idle and was given work)."""

    def interactive_load(self, replica: Replica, engine_wait_s: float) -> tuple[int, int, int]:
        """Interactive requests held, queued for it and stalled, as the worker counts them."""

    def batch_done(self) -> None:
        """Every line has its result."""

BATCH_ID = "batch_sim"
# Prompt ids of batch lines come from this index up, so they never share a prefix with the
# interactive trace's requests (whose ids are seeded by their trace position).
PROMPT_INDEX_BASE = 1 << 40
# A worker's pull loops (two per band: premium, standard, batch) share its slots; one pull
# request reserves at most capacity // PULLERS of them (`services.worker.slots.SlotBudget`).
PULLERS = 6


@dataclass(frozen=True)
class LineLengths:
    """Lognormal prompt and output lengths (median and p90, clipped to [min, max]).

    The default is an offline-eval / synthetic-data / short-document job: prompts of a few
    hundred tokens to a couple of thousand (median 600, p90 1,500), outputs of a few hundred
    (median 250, p90 550, at most 1,024). Short-to-medium prompts with long outputs are the
    batch work decode-bound spare capacity suits: decoding another sequence costs a fraction of
    a millisecond per step, while every 512-token prefill chunk adds tens of milliseconds to the
    step every interactive stream on that replica waits for.
    """

    input_median: float = 600.0
    input_p90: float = 1_500.0
    input_min: int = 32
    input_max: int = 8_192
    output_median: float = 250.0
    output_p90: float = 550.0
    output_min: int = 16
    output_max: int = 1_024

    def mix(self) -> Mix:
        """The same distributions as an `tools.capacity.mix` mix (the planner's input)."""
        return mix_mod.from_spec({"name": "batch", "classes": [{
            "name": "batch line",
            "input_tokens": {"dist": "lognormal", "median": self.input_median, "p90": self.input_p90,
                             "min": self.input_min, "max": self.input_max},
            "output_tokens": {"dist": "lognormal", "median": self.output_median, "p90": self.output_p90,
                              "min": self.output_min, "max": self.output_max},
        }]})

    def sample(self, n: int, seed: int) -> list[tuple[int, int]]:
        rng = random.Random(seed)
        mix = self.mix()
        return [(r.input_tokens, r.output_tokens) for r in (mix.sample(rng) for _ in range(n))]


@dataclass
class BatchSpec:
    """One batch submitted to the fleet at `start_s`."""

    lines: int = 1_000
    lengths: LineLengths = field(default_factory=LineLengths)
    seed: int = 11
    start_s: float = 0.0
    feed_interval_s: float = 0.1  # the batch service's feeding tick (INFERBUS_BATCH_FEED_INTERVAL_S)
    feed_config: Any = None  # services.batch.feed.FeedConfig; None: its defaults
    preemption_config: Any = None  # services.worker.preemption.PreemptionConfig; None: its defaults
    # Oracle baseline: each replica keeps this many batch lines, no feed or preemption policy.
    fixed_concurrency: int | None = None
    # The run ends when the interactive trace is done, with the batch wherever it got to.
    stop_with_interactive: bool = False
    # Keep each line's output token ids (tests compare them with an uninterrupted run).
    record_output: bool = False
    # A simulator guard, not a policy: the worker requeues preempted lines without a limit.
    max_attempts: int = 1_000
    # Overrides of what the worker does (for experiments): pull a batch line only while fewer than
    # this many of the worker's batch lines are still in prefill (None: the PreemptionPolicy's
    # `max_prefilling`, as the worker).
    max_prefilling: int | None = None
    series_bin_s: float = 1.0

    def __post_init__(self) -> None:
        if self.lines < 0:
            raise ValueError("lines must not be negative")
        if self.fixed_concurrency is not None and self.fixed_concurrency < 0:
            raise ValueError("fixed_concurrency must not be negative")


@dataclass(eq=False, slots=True)
class BatchLine:
    line: int
    request_id: str
    input_tokens: int
    output_tokens: int  # the line's budget (ignore_eos: it generates exactly this many)
    prompt: list[int] | None = None  # original prompt ids (while the line is unfinished)
    generated: list[int] = field(default_factory=list)  # output ids of ended attempts
    attempt: int = 0
    attempt_generated: int = 0  # output tokens of the current attempt so far
    request: Request | None = None
    replica: Replica | None = None
    started_s: float = 0.0  # the current attempt entered an engine
    published_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    preempted: int = 0  # worker preemptions (abort + requeue)
    results: int = 0  # results published (exactly one when the batch is done)
    output: list[int] | None = None  # final output ids (record_output)
    status: Literal["unpublished", "queued", "running", "completed", "failed"] = "unpublished"
    error: str = ""

    @property
    def done_tokens(self) -> int:
        return len(self.generated) + self.attempt_generated


class Feed(Protocol):
    def observe(self, load: m.WorkerLoad) -> None: ...
    def allowance(self, outstanding: int) -> int: ...


class Preemption(Protocol):
    def pull_room(self, capacity: int, interactive_running: int, batch_running: int, *, batch_prefilling: int,
                  reserved: int, last: Check, draining: bool = False) -> int: ...
    def check(self, state: WorkerState, bus_waiting: int = 0) -> Check: ...


class _Unlimited:
    """Oracle feed: keeps the queue stocked; sees nothing."""

    def __init__(self, stock: int) -> None:
        self.stock = stock

    def observe(self, load: m.WorkerLoad) -> None:
        pass

    def allowance(self, outstanding: int) -> int:
        return max(0, self.stock - outstanding)


class _Fixed:
    """Oracle worker: exactly `concurrency` batch lines per replica, never preempts."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency

    def pull_room(self, capacity: int, interactive_running: int, batch_running: int, *, batch_prefilling: int,
                  reserved: int, last: Check, draining: bool = False) -> int:
        return max(0, min(self.concurrency - batch_running, capacity - interactive_running - batch_running))

    def check(self, state: WorkerState, bus_waiting: int = 0) -> Check:
        return Check()


def make_policies(spec: BatchSpec, clock: Callable[[], float], replicas: int,
                  engine_priority: bool = True, gpu: str = "", tp: int = 0) -> tuple[Feed, Preemption, Any]:
    """The production policies (or the oracle's); the third value builds a `RunningLine`.
    `engine_priority`: the engines schedule by priority (the worker reads it from /server_info);
    `gpu`, `tp`: the engines' (the worker sizes its step-time cap with them, as `Worker` does)."""
    if spec.fixed_concurrency is not None:
        return _Unlimited(2 * spec.fixed_concurrency * max(1, replicas) + 16), _Fixed(spec.fixed_concurrency), None
    from services.batch.feed import FeedConfig, FeedPolicy
    from services.worker.preemption import PreemptionConfig, PreemptionPolicy, RunningLine

    feed = FeedPolicy(clock, spec.feed_config if spec.feed_config is not None else FeedConfig())
    config = spec.preemption_config if spec.preemption_config is not None else PreemptionConfig()
    preemption = PreemptionPolicy(config.for_engine(gpu, tp), engine_priority=engine_priority)
    return feed, preemption, RunningLine


class BatchBand:
    """The batch service, the batch queue and the workers' batch side, for one fleet (`Fleet`)."""

    def __init__(self, sim: Fleet, spec: BatchSpec) -> None:
        self.sim = sim
        self.spec = spec
        self.lines = [
            BatchLine(line=i, request_id=m.batch_request_id(BATCH_ID, i), input_tokens=n_in, output_tokens=n_out)
            for i, (n_in, n_out) in enumerate(spec.lengths.sample(spec.lines, spec.seed))
        ]
        engine = sim.config.engine
        self.feed, self.preemption, self._batch_run = make_policies(spec, sim.loop.clock, sim.config.replicas,
                                                                    engine.priority_scheduling, engine.gpu, engine.tp)
        policy_config = getattr(self.preemption, "config", None)
        self._engine_wait_s = getattr(policy_config, "engine_wait_s", 0.5)
        self._max_attempts = getattr(policy_config, "max_attempts", 5)
        self.queue: deque[BatchLine] = deque()
        self.next_line = 0  # lines[:next_line] are published
        self.outstanding = 0  # published, no result yet
        self.remaining = len(self.lines)  # no result yet
        self.preemptions = 0
        self.requeued_dead = 0
        self.recompute_tokens = 0  # context resumed attempts prefill again (before cache hits): preemption's price
        self.engine_retractions = 0
        self.reports_seen = 0
        self._rotate = 0
        self.bin_s = spec.series_bin_s
        # Per bin: batch output tokens generated, batch prompt tokens of first attempts prefilled,
        # preemptions, batch lines in flight (sampled at feed ticks).
        self.out_bins: dict[int, int] = {}
        self.in_bins: dict[int, int] = {}
        self.preempt_bins: dict[int, int] = {}
        self.in_flight_samples: list[tuple[float, int, int]] = []  # t, published outstanding, running
        self.spread_samples: list[tuple[float, int, float]] = []  # t, most lines on one replica, mean
        self.feed_states: list[tuple[float, Any]] = []  # t, FeedPolicy.state() at each feed tick

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def start(self) -> None:
        if self.lines:
            self.sim.loop.at(self.spec.start_s, self._feed_tick)

    # ---- the batch service -------------------------------------------------------------------------

    def observe(self, load: m.WorkerLoad) -> None:
        self.reports_seen += 1
        self.feed.observe(load)

    def _feed_tick(self) -> None:
        sim = self.sim
        if self.next_line < len(self.lines):
            grant = self.feed.allowance(self.outstanding)
            if grant > 0:
                self._publish(min(grant, len(self.lines) - self.next_line))
        per_replica = [len(r.batch_jobs) for r in sim.replicas if r.alive]
        running = sum(per_replica)
        self.in_flight_samples.append((sim.loop.now, self.outstanding, running))
        if running:
            self.spread_samples.append((sim.loop.now, max(per_replica), running / len(per_replica)))
        state = getattr(self.feed, "state", None)
        if state is not None:
            self.feed_states.append((sim.loop.now, state()))
        if not self.done and not sim.done:
            sim.loop.after(self.spec.feed_interval_s, self._feed_tick)

    def _publish(self, count: int) -> None:
        now = self.sim.loop.now
        for line in self.lines[self.next_line : self.next_line + count]:
            line.published_s = now
            line.status = "queued"
            self.queue.append(line)
        self.next_line += count
        self.outstanding += count
        self._offer()

    def _offer(self) -> None:
        """New lines on the queue: idle replicas with batch room pull now (busy ones at their step's end)."""
        replicas = self.sim.replicas
        n = len(replicas)
        if not n:
            return
        start = self._rotate % n
        self._rotate += 1
        for i in range(n):
            if not self.queue:
                return
            replica = replicas[(start + i) % n]
            if replica.alive and not replica.stepping:
                self.pull(replica)

    # ---- a worker's batch side ---------------------------------------------------------------------

    def pull(self, replica: Replica) -> None:
        """Batch lines into the slots the preemption policy grants, at most a pull's fair share."""
        if not self.queue or not replica.alive or replica.state != "serving":
            return
        capacity = replica.engine.config.max_running_requests
        prefilling = sum(1 for line in replica.batch_jobs.values() if line.attempt_generated == 0)
        # Pulls here are instant: no slots are reserved by pulls on their way.
        if self.spec.max_prefilling is not None:  # an experiment's override of the policy's limit
            room = self.preemption.pull_room(capacity, len(replica.jobs), len(replica.batch_jobs), batch_prefilling=0,
                                             reserved=0, last=replica.batch_check)
            room = min(room, self.spec.max_prefilling - prefilling)
        else:
            room = self.preemption.pull_room(capacity, len(replica.jobs), len(replica.batch_jobs),
                                             batch_prefilling=prefilling, reserved=0, last=replica.batch_check)
        room = min(room, max(1, capacity // PULLERS))
        while room > 0 and self.queue:
            self._dispatch(replica, self.queue.popleft())
            room -= 1

    def check(self, replica: Replica) -> None:
        """The worker's preemption check (every load tick, `PreemptionPolicy.check`, as the worker
        runs it): waiting interactive work blocks batch pulls until the next check, and the
        policy's victims are aborted and requeued with their progress."""
        if self._batch_run is None:
            return  # the oracle never preempts or blocks
        batch = replica.batch_jobs
        capacity = replica.engine.config.max_running_requests
        held, queued, stalled = self.sim.interactive_load(replica, self._engine_wait_s)
        runs = [
            self._batch_run(request_id=line.request_id, context_tokens=line.input_tokens + line.done_tokens,
                            generated=line.done_tokens, started=line.started_s)
            for line in batch.values()
        ]
        state = WorkerState(capacity=capacity, interactive=held, interactive_stalled=stalled, batch=runs)
        # The worker asks the bus only when short of slots; here the queue is known without asking.
        replica.batch_check = check = self.preemption.check(state, queued)
        if not check.victims:
            return
        by_id = {line.request_id: rid for rid, line in batch.items()}
        replica.batch_aborts.extend(by_id[name] for name in check.victims if name in by_id)
        if not replica.stepping:
            self.abort(replica)

    def abort(self, replica: Replica) -> None:
        """Abort the lines `check` named, between engine steps (as an engine applies an abort), and
        requeue them with their progress; lines that finished meanwhile are left alone."""
        rids, replica.batch_aborts = replica.batch_aborts, []
        for rid in rids:
            line = replica.batch_jobs.get(rid)
            if line is None:
                continue
            for update in replica.engine.abort(rid, "preempted for interactive work", exact=True):
                line.attempt_generated = update.num_output_tokens
            self._end_attempt(replica, rid, line)
            line.preempted += 1
            self.preemptions += 1
            self._count(self.preempt_bins, 1)
            verdict = attempt_verdict(now=self.sim.loop.now, deadline=math.inf, attempt=line.attempt,
                                      max_attempts=self._max_attempts, finish=None, give_way="preempted")
            assert verdict.status == "requeued"  # giving way is never the line's fault
            self._requeue(line)

    def _dispatch(self, replica: Replica, line: BatchLine) -> None:
        sim = self.sim
        if line.prompt is None:
            line.prompt = sim.prompts.ids(TraceRequest(0.0, line.input_tokens, line.output_tokens),
                                          PROMPT_INDEX_BASE + line.line)
        prompt, budget = continuation.engine_input(line.prompt, line.generated, line.output_tokens)
        request = Request(
            rid=f"{line.request_id}-{line.attempt:02d}", input_ids=prompt, priority=bands.ENGINE_PRIORITY["batch"],
            sampling=SamplingParams(max_new_tokens=budget, temperature=0.0, ignore_eos=True),
        )
        engine = replica.engine
        if not replica.stepping and engine.now < sim.loop.now:
            engine.advance(sim.loop.now - engine.now)
        try:
            engine.add(request)
        except RequestRejected as error:
            self._result(line, "failed", str(error))
            return
        if line.attempt:
            self.recompute_tokens += len(prompt)
        line.status = "running"
        line.request = request
        line.replica = replica
        line.started_s = sim.loop.now
        line.attempt_generated = 0
        replica.batch_jobs[request.rid] = line
        if not replica.stepping:
            sim.step(replica)

    def on_update(self, replica: Replica, update: RequestUpdate, now: float) -> None:
        """One engine update of a batch line, at the end of the step that produced it."""
        rid = update.request.rid
        line = replica.batch_jobs[rid]
        produced = update.num_output_tokens
        new = produced - line.attempt_generated
        if new > 0:
            if line.first_token_s is None:
                line.first_token_s = now
                self._count(self.in_bins, line.input_tokens)
            self._count(self.out_bins, new)
        line.attempt_generated = produced
        if update.finish_reason is None:
            return
        self._end_attempt(replica, rid, line)
        # How the attempt ends is the worker's decision (`attempt_verdict`): an abort the engine made
        # on its own is a retryable failure, requeued until the line's attempts run out.
        verdict = attempt_verdict(now=now, deadline=math.inf, attempt=line.attempt, max_attempts=self._max_attempts,
                                  finish=update.finish_reason.get("type"))
        if verdict.status == "requeued":
            self._requeue(line)
            return
        replica.completed += 1  # as the worker counts: attempts that report the line's result
        replica.completed_batch += 1
        if verdict.status == "completed":
            self._result(line, "completed")
        else:
            self._result(line, "failed", str(update.finish_reason.get("message", "aborted")))

    def _end_attempt(self, replica: Replica, rid: str, line: BatchLine) -> None:
        request = line.request
        assert request is not None
        del replica.batch_jobs[rid]
        self.engine_retractions += request.preemptions
        line.generated.extend(request.output_ids[: line.attempt_generated])
        line.attempt_generated = 0
        line.request = None
        line.replica = None

    def _requeue(self, line: BatchLine) -> None:
        line.attempt += 1
        if line.attempt >= self.spec.max_attempts:
            self._result(line, "failed", f"gave up after {line.attempt} attempts")
            return
        if len(line.generated) >= line.output_tokens:
            self._result(line, "completed")  # everything was generated; only the finish was lost
            return
        line.status = "queued"
        self.queue.append(line)
        self._offer()

    def _result(self, line: BatchLine, status: Literal["completed", "failed"], error: str = "") -> None:
        line.results += 1
        if line.results > 1:
            raise AssertionError(f"batch line {line.line} reported twice")
        line.status = status
        line.error = error
        line.finish_s = self.sim.loop.now
        if self.spec.record_output:
            line.output = list(line.generated)
        line.prompt = None
        line.generated = []
        self.outstanding -= 1
        self.remaining -= 1
        if self.done:
            self.sim.batch_done()

    def recover(self, replica: Replica) -> None:
        """A dead replica's batch lines go back to the queue with what they had generated."""
        for rid, line in sorted(replica.batch_jobs.items(), key=lambda item: item[1].line):
            self._end_attempt(replica, rid, line)
            self.requeued_dead += 1
            self._requeue(line)

    def _count(self, bins: dict[int, int], value: int) -> None:
        key = int(self.sim.loop.now // self.bin_s)
        bins[key] = bins.get(key, 0) + value

    # ---- results -----------------------------------------------------------------------------------

    def report(self) -> BatchReport:
        lines = self.lines
        completed = [line for line in lines if line.status == "completed"]
        started = [line for line in lines if line.first_token_s is not None]
        begin = self.spec.start_s
        end = max((line.finish_s for line in lines if line.finish_s is not None), default=begin)
        end = max(end, self.sim.loop.now if not self.done else end)
        span = max(end - begin, 1e-9)
        output = sum(self.out_bins.values())
        prompt = sum(self.in_bins.values())
        latencies = [line.finish_s - line.published_s for line in completed
                     if line.finish_s is not None and line.published_s is not None]
        return BatchReport(
            lines=len(lines), completed=len(completed), failed=sum(line.status == "failed" for line in lines),
            unfinished=sum(line.status not in ("completed", "failed") for line in lines),
            started=len(started), published=self.next_line, output_tokens=output, input_tokens=prompt,
            output_tok_s=output / span, input_tok_s=prompt / span, span_s=span,
            preemptions=self.preemptions, preempted_lines=sum(line.preempted > 0 for line in lines),
            requeued_dead=self.requeued_dead, recompute_tokens=self.recompute_tokens,
            engine_retractions=self.engine_retractions, line_latency_p50_s=percentile(latencies, 50),
            line_latency_p90_s=percentile(latencies, 90), reports_seen=self.reports_seen,
        )

    def tokens_between(self, start_s: float, end_s: float) -> tuple[int, int]:
        """Batch (output, input) tokens counted in the bins that lie within [start_s, end_s)."""
        first, last = math.ceil(start_s / self.bin_s), math.floor(end_s / self.bin_s)
        keys = range(first, last)
        return sum(self.out_bins.get(k, 0) for k in keys), sum(self.in_bins.get(k, 0) for k in keys)


@dataclass
class BatchReport:
    lines: int
    completed: int
    failed: int
    unfinished: int
    started: int
    published: int
    output_tokens: int  # generated by batch lines (every token counted once: resumes do not regenerate)
    input_tokens: int  # prompt tokens of lines whose first token came (each line's prompt once)
    output_tok_s: float  # over the batch's span: submission → last result (or the run's end)
    input_tok_s: float
    span_s: float
    preemptions: int  # worker preemptions (abort + requeue with progress)
    preempted_lines: int
    requeued_dead: int
    recompute_tokens: int  # context (prompt + generated) resumed attempts prefill again, before prefix-cache hits
    engine_retractions: int  # engine-level retractions of batch lines (KV full: recompute in place)
    line_latency_p50_s: float
    line_latency_p90_s: float
    reports_seen: int
