"""Whether the worker's engine is up, and when to look again while it is not.

A worker whose engine is down must not take requests (each would fail at once and bounce between
workers), must not say it is ready, and must probe the engine with a growing delay rather than in
a tight loop. When the engine answers again it may have restarted: what the worker believed about
it (loaded adapters, limits) has to be learned again.

Pure: the caller brings the clock and does the probing.
"""

from __future__ import annotations

from collections.abc import Callable


class EngineHealth:
    def __init__(self, clock: Callable[[], float], *, first_delay_s: float = 0.1, max_delay_s: float = 5.0) -> None:
        self.clock = clock
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.up = True
        self.down_since: float | None = None
        self.failures = 0  # consecutive failed probes (or requests) since it went down

    def failed(self) -> float:
        """The engine did not answer: seconds to wait before the next probe (doubling, capped)."""
        if self.up:
            self.up = False
            self.down_since = self.clock()
            self.failures = 0
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** self.failures)
        self.failures += 1
        return delay

    def recovered(self) -> bool:
        """The engine answered; True when it had been down (it may be a new engine process)."""
        was_down = not self.up
        self.up, self.down_since, self.failures = True, None, 0
        return was_down
