"""Whether a prefill worker takes a prefill half, and which batch half gives way for it. Pure: no
I/O, no clock (the worker passes in what it holds).

A prefill worker holds at most `capacity` halves (its engine's max_running_requests: beyond that a
prompt waits in the engine's queue while another prefill worker may be free), and batch halves
only while fewer than `batch_max_prefilling` of them run (batch prompts take chunked-prefill budget
from interactive ones). An interactive half that finds every slot taken while batch halves run
does not wait for them, nor go round the other prefill workers: the worker takes it and one batch
half gives way, as a decode or aggregated worker preempts a batch line for interactive work. The
batch half's engine request is aborted, and its decode worker hands the line back to the batch
queue (`prefill_choice.retry`: a preempted batch prefill is not retried at once elsewhere).

The half that gives way is the batch half this worker sent its engine first: the one the engine
is computing (it takes prompts in the order they reach it).
An engine continues a chunked prefill in progress before it admits any waiting prompt (SGLang's
chunked request takes the step's chunk budget first; priority only orders the waiting queue), so
aborting a batch half still waiting in the engine would free a slot and nothing else: the
interactive prompt would wait for the whole batch prompt ahead of it (live, with the half taken
last preempted instead: 10.7 s for a 16-token prompt behind a 24k-token one, against 0.3 s;
tests/test_e2e_pd_preemption.py). The batch halves still waiting yield to it by engine priority.
The work lost is the chunks computed so far.

The batch half is aborted only once the interactive prompt is past its bootstrap handshake in the
engine (`may_abort_victim`): an engine that drops its chunked prompt takes the next from its
waiting queue at once, and a prompt still waiting for its decode engine's handshake is not in that
queue yet, so an abort sent at admission let the next batch prompt start its chunked prefill first
(live, on a loaded machine: 11.4 s for the interactive prompt).

Halves already giving way (preempted, aborted, their engine request still ending) count neither
as taken slots nor as victims: a slot freed for one interactive half is not freed twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HeldHalf:
    """A half a prefill worker holds, as the admission sees it."""

    key: Hashable
    batch: bool
    sent_at: float  # when this worker sent it to its engine (inf: not yet)
    giving_way: bool = False  # aborted (preempted, cancelled, given up): its slot is being freed


@dataclass(frozen=True)
class Admission:
    accepted: bool
    reason: str = ""  # a refusal's: "full"
    victim: Hashable | None = None  # the batch half to preempt for this one


def admit(*, batch: bool, capacity: int, batch_max_prefilling: int, held: Sequence[HeldHalf]) -> Admission:
    """Whether to take a new half (`batch`: of a batch line), given the halves held."""
    live = [h for h in held if not h.giving_way]
    live_batch = [h for h in live if h.batch]
    if len(live) >= capacity:
        if batch or not live_batch:
            return Admission(False, "full")
        victim = min(live_batch, key=lambda h: (h.sent_at, str(h.key)))
        return Admission(True, victim=victim.key)
    if batch and len(live_batch) >= batch_max_prefilling:
        return Admission(False, "full")
    return Admission(True)


def may_abort_victim(*, sent: int, engine_ready: int) -> bool:
    """Whether the batch half preempted for an interactive one may be aborted now: once the engine
    holds, past their bootstrap handshake (running, waiting to be scheduled or sending their KV),
    as many prompts as this worker has sent it and not seen end, the interactive one among them."""
    return engine_ready >= sent
