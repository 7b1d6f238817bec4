"""A heap-based discrete-event loop on a virtual clock.

Nothing here sleeps or reads a wall clock: `run()` pops the earliest event, sets `now` to its
time and calls it. Events at the same time run in the order they were scheduled (a sequence
number breaks ties), so a run is a deterministic function of its inputs.

Cancelling is by generation, not by removal: a callback that may go stale (a replica's next step
after the replica died) checks its own state when it fires. That keeps `at()` a single
`heappush` of a tuple, which is what the simulator's hot path needs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    __slots__ = ("now", "events_run", "_heap", "_seq", "_stopped")

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self._stopped = False

    def __len__(self) -> int:
        return len(self._heap)

    def clock(self) -> float:
        """The virtual time: pass `loop.clock` wherever a policy wants a clock."""
        return self.now

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback(*args)` at virtual time `when` (never earlier than now)."""
        if when < self.now:
            when = self.now
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, callback, args))

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, callback, *args)

    def stop(self) -> None:
        """End `run()` after the event being processed."""
        self._stopped = True

    def run(self, until: float | None = None) -> int:
        """Process events in time order until none are left, `stop()` is called, or the next event
        is later than `until` (then `now` is set to `until`). Returns the number of events run."""
        heap = self._heap
        pop = heapq.heappop
        limit = float("inf") if until is None else until
        self._stopped = False
        count = 0
        while heap and not self._stopped:
            if heap[0][0] > limit:
                self.now = limit
                break
            when, _, callback, args = pop(heap)
            self.now = when
            callback(*args)
            count += 1
        self.events_run += count
        return count
