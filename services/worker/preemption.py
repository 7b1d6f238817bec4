"""Which slots batch lines may take on a worker, and which running lines give way: pure policy.

Batch lines are filler. A worker lets them hold at most a share of its slots and never the last
`headroom` ones, so an interactive arrival usually finds a free slot at once. When interactive
work waits anyway, batch lines give way, in one of two ways:

- Inside the engine, by engine priority where the engine has it (SGLang's
  --enable-priority-scheduling; `engine_priority`): batch lines run at the lowest priority, so the
  engine admits waiting interactive requests first and retracts batch lines itself when slots or
  KV run short, in place, keeping their progress. The worker then leaves interactive work waiting
  in the engine to the engine. Aborting decoding batch lines for it would not help it (most such
  waits are for chunked-prefill budget, not for a slot) and would throw their KV away: every abort
  is a re-prefill elsewhere. In the fleet simulator at the peak, these aborts (818 in 100 s)
  halved what batch got at the same interactive latency.
- By abort, for what the engine cannot see or does not prioritise: interactive requests queued on
  the bus for this worker while its slots are taken, and, without engine priority, interactive
  requests its engine keeps waiting. The worker aborts batch lines and puts them back on the batch
  queue with the text generated so far, so the next attempt resumes instead of restarting. The
  cheapest lines to resume go first (fewest context tokens to prefill again), and never more than
  the waiting work needs.

No I/O and no clock: the worker (and the fleet simulator) pass in the counts. Both run the same
check on every load tick (`check`, with `asks_bus` saying whether it needs the interactive work
queued on the bus) and size their batch pulls with `pull_room` from its last answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inferbus import step_cost


@dataclass(frozen=True)
class PreemptionConfig:
    # Largest share of the worker's slots that batch lines may hold (rounded down): the rest stays
    # interactive's even when no interactive request is running.
    batch_share: float = 0.75
    # Slots left free for interactive arrivals while batch runs: batch never takes them, and the
    # worker looks for waiting interactive work (and preempts) only once fewer than this are free.
    headroom: int = 1
    # An interactive request the worker handed to its engine that has produced no token after this
    # long counts as waiting inside the engine (a fresh one is merely being prefilled).
    engine_wait_s: float = 0.5
    # Batch lines of this worker still without a first token (being prefilled, or reserved and on
    # their way) before it pulls no more: a pile of batch prompts in prefill takes chunked-prefill
    # budget from interactive prompts and delays them all.
    max_prefilling: int = 1
    # Step-time cap on batch lines (`inferbus.step_cost`, as the batch feed's): at most
    # `max_slowdown · (step_seqs + interactive running)` batch lines, `step_seqs` being the engine's
    # base step in sequences (the worker sets it from its engine's GPU and TP). The feed counts the
    # same cap fleet-wide; enforcing it where lines are pulled spreads them over the fleet instead of
    # piling them on the first workers to pull.
    max_slowdown: float = 0.06
    step_seqs: float = step_cost.DEFAULT.seqs
    # Attempts a batch line gets across retryable engine failures before it ends with an error.
    max_attempts: int = 5

    def for_engine(self, gpu: str, tp: int) -> PreemptionConfig:
        """This config with the step-time cap of `tp` GPUs of type `gpu` (unchanged when the
        timing model does not know them)."""
        cost = step_cost.engine_step_cost(gpu, tp)
        return self if cost is None else dataclasses.replace(self, step_seqs=cost.seqs)

    def __post_init__(self) -> None:
        if not 0.0 <= self.batch_share <= 1.0:
            raise ValueError("batch_share must be between 0 and 1")
        if self.headroom < 0:
            raise ValueError("headroom must be >= 0")
        if self.engine_wait_s < 0:
            raise ValueError("engine_wait_s must be >= 0")
        if self.max_prefilling < 1 or self.max_slowdown < 0 or self.step_seqs <= 0:
            raise ValueError("max_prefilling must be >= 1, max_slowdown >= 0 and step_seqs > 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


@dataclass(frozen=True)
class RunningLine:
    """One running batch line, as the policy sees it."""

    request_id: str
    context_tokens: int  # prompt + generated so far: what a resume prefills again
    generated: int  # completion tokens so far, earlier attempts included
    started: float  # when this attempt started (unix seconds)


@dataclass(frozen=True)
class WorkerState:
    """One worker as the preemption check sees it."""

    capacity: int  # its request slots
    interactive: int  # interactive requests it holds
    interactive_stalled: int  # of them, kept waiting in its engine (see `PreemptionPolicy.stalled`)
    batch: Sequence[RunningLine]  # its batch lines that may give way (not already giving way)
    reserved: int = 0  # slots reserved by batch pulls on their way: not interactive's to count on
    draining: bool = False


@dataclass(frozen=True)
class Check:
    """The answer of one preemption check, in force until the next."""

    interactive_waiting: int = 0  # queued on the bus for this worker: no batch pulls meanwhile
    interactive_stalled: int = 0  # kept waiting in its engine: no batch pulls without engine priority
    victims: list[str] = field(default_factory=list)  # batch lines to abort and requeue now


class PreemptionPolicy:
    def __init__(self, config: PreemptionConfig = PreemptionConfig(), *, engine_priority: bool = True) -> None:
        """`engine_priority`: the engine admits and retracts by request priority, so interactive
        work waiting inside it is the engine's to serve (see the module docstring)."""
        self.config = config
        self.engine_priority = engine_priority

    def batch_slots(self, capacity: int) -> int:
        """The most batch lines a worker of `capacity` slots ever holds."""
        return max(0, min(int(capacity * self.config.batch_share), capacity - self.config.headroom))

    def step_cap(self, interactive_running: int) -> int:
        """The most batch lines beside `interactive_running` within the step-time cap."""
        return step_cost.batch_cap(self.config.max_slowdown, self.config.step_seqs, interactive_running)

    def batch_room(self, capacity: int, interactive_running: int, batch_running: int, *,
                   batch_prefilling: int = 0, interactive_stalled: int = 0) -> int:
        """How many more batch lines this worker may take now.

        `batch_running` counts batch lines held and slots reserved for batch pulls;
        `batch_prefilling` those of them without a first token yet (reserved ones included);
        `interactive_stalled` interactive requests its engine keeps waiting (without engine priority,
        no pulls then: a line preempted for them must not come straight back; with it, a new line
        waits in the engine behind them).
        """
        if interactive_stalled > 0 and not self.engine_priority:
            return 0
        c = self.config
        free_beyond_headroom = capacity - interactive_running - batch_running - c.headroom
        return max(0, min(self.batch_slots(capacity) - batch_running, free_beyond_headroom,
                          self.step_cap(interactive_running) - batch_running,
                          c.max_prefilling - batch_prefilling))

    def victims(
        self,
        capacity: int,
        interactive_running: int,
        interactive_waiting: int,
        batch: Sequence[RunningLine],
        *,
        engine_waiting: int = 0,
    ) -> list[str]:
        """Request ids of batch lines to preempt now so that waiting interactive work gets slots.

        `interactive_waiting`: interactive requests queued for this worker that need a slot; free
        slots serve them first. `engine_waiting`: interactive requests the worker already holds
        that its engine keeps waiting: without engine priority each needs a batch line out of the
        engine; with it the engine retracts what they need.
        """
        free = max(0, capacity - interactive_running - len(batch))
        stalled = 0 if self.engine_priority else max(0, engine_waiting)
        needed = max(0, interactive_waiting - free) + stalled
        if needed <= 0 or not batch:
            return []
        # Cheapest to resume first; among equals the one started last (it has run the least).
        order = sorted(batch, key=lambda run: (run.context_tokens, -run.started, run.request_id))
        return [run.request_id for run in order[:needed]]

    def stalled(self, now: float, engine_waiting: int, unstarted_since: Iterable[float]) -> int:
        """Interactive requests a worker's engine keeps waiting: handed to the engine more than
        `engine_wait_s` ago (`unstarted_since`, for those without a first token) and, at most, what
        the engine reports waiting."""
        wait = self.config.engine_wait_s
        return min(engine_waiting, sum(1 for since in unstarted_since if now - since > wait))

    def asks_bus(self, state: WorkerState) -> bool:
        """Whether `check` needs the interactive requests queued on the bus for this worker: only
        while batch lines run and fewer than `headroom` slots are free (otherwise waiting
        interactive work finds a slot anyway)."""
        if not state.batch or state.draining:
            return False
        free = state.capacity - state.reserved - state.interactive - len(state.batch)
        return free < self.config.headroom

    def check(self, state: WorkerState, bus_waiting: int = 0) -> Check:
        """Every load tick: which batch lines give way now, and what blocks batch pulls until the
        next tick. `bus_waiting`: interactive requests queued for the worker (asked only when
        `asks_bus`). Interactive work its engine keeps waiting blocks batch pulls, with or without
        batch lines running, so a line preempted for it does not come straight back."""
        if not state.batch or state.draining:
            return Check(interactive_stalled=state.interactive_stalled)
        waiting = bus_waiting if self.asks_bus(state) else 0
        # Slots reserved by batch pulls are not interactive's; lines already giving way are.
        victims = self.victims(state.capacity - state.reserved, state.interactive, waiting, state.batch,
                               engine_waiting=state.interactive_stalled)
        return Check(interactive_waiting=waiting, interactive_stalled=state.interactive_stalled, victims=victims)

    def pull_room(self, capacity: int, interactive_running: int, batch_running: int, *, batch_prefilling: int,
                  reserved: int, last: Check, draining: bool = False) -> int:
        """Batch lines a worker may pull now, given the last check. `batch_running` counts its
        batch lines (giving way or not), `batch_prefilling` those without a first token;
        `reserved` slots of batch pulls on their way count as running and prefilling both."""
        if draining or last.interactive_waiting:
            return 0
        return self.batch_room(capacity, interactive_running, batch_running + reserved,
                               batch_prefilling=batch_prefilling + reserved,
                               interactive_stalled=last.interactive_stalled)
