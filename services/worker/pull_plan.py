"""Which of a worker's consumers pull now, and for how many slots. Pure: no I/O, no clock.

A pull request holds the slots it asks for until messages fill them or it expires, so a long-poll
on an empty queue pins slots that another queue's waiting requests need. The plan therefore:

1. gives free slots first to consumers known to have requests waiting (the count the server sent
   with the last message they received, or the consumer's pending count when the worker asked),
   most important first, as many as wait;
2. only then lets each remaining consumer keep one slot in a long-poll (one is enough to learn
   that work arrived: the first message says how many more wait behind it), when there are
   slots for all of them;
3. otherwise gives those consumers short turns in rotation, one slot each, so that every queue is
   looked at within a few turns and its slots come back within one.

So a free slot pulls whenever work is known to wait for it, and at most one slot per idle
consumer is held by a long-poll, and only when no known work goes without (step 1 came first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConsumerState:
    outstanding: int  # slots its pull request in flight holds (one request at a time per consumer)
    waiting: int  # requests known to wait on it, from the last message it received; 0: none known
    room: int  # at most this many slots may it take now (a batch consumer: what preemption grants)


@dataclass(frozen=True)
class PullOrder:
    consumer: int  # index into the consumers, most important first
    slots: int
    long: bool  # a long-poll (may wait for work to arrive) or a short turn


@dataclass(frozen=True)
class PullPlan:
    orders: tuple[PullOrder, ...]
    turn: int  # where the next rotation of short turns starts


def plan_pulls(free: int, consumers: Sequence[ConsumerState], turn: int = 0) -> PullPlan:
    """The pull requests to send now, given `free` unreserved slots."""
    orders: list[PullOrder] = []
    left = free
    for index, consumer in enumerate(consumers):
        if consumer.waiting <= 0 or consumer.outstanding or consumer.room <= 0:
            continue
        slots = min(consumer.waiting, consumer.room, left)
        if slots > 0:
            orders.append(PullOrder(index, slots, long=False))
            left -= slots
    idle = [index for index, consumer in enumerate(consumers)
            if consumer.waiting <= 0 and not consumer.outstanding and consumer.room > 0]
    if not idle or left <= 0:
        return PullPlan(tuple(orders), turn)
    if left >= len(idle):
        orders.extend(PullOrder(index, 1, long=True) for index in idle)
        return PullPlan(tuple(orders), turn)
    # Scarce: short turns, starting where the last rotation stopped.
    count = len(consumers)
    ordered = sorted(idle, key=lambda index: (index - turn) % count)
    chosen = ordered[:left]
    orders.extend(PullOrder(index, 1, long=False) for index in chosen)
    return PullPlan(tuple(orders), (chosen[-1] + 1) % count)
