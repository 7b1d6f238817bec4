"""When to restart a service that exited: exponential backoff, capped, forgiven after a healthy run.

Pure (the clock is passed in): `inferbus up` asks `Backoff.due(now)` for each dead process and
restarts it when it says so; the tests drive it with a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass

# A worker that gave its GPU up exits with this (EX_TEMPFAIL): replace the replica, engine included.
EXIT_GPU_DEATH = 75


@dataclass
class Backoff:
    """The restart schedule of one process.

    The first restart comes `initial_s` after the exit, each next one twice as late, at most `max_s`;
    a process that then stays up `stable_s` starts over at `initial_s` (a crash a day is not a crash loop).
    """

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    restarts: int = 0  # restarts since the last stable run
    delay_s: float = 0.0  # the wait before the pending restart
    exited_at: float | None = None  # when the exit was noticed; None while running
    started_at: float = 0.0

    def exited(self, now: float) -> float:
        """The process is gone (noticed at `now`): returns how long until it is restarted."""
        if self.exited_at is not None:
            return max(0.0, self.exited_at + self.delay_s - now)
        if now - self.started_at >= self.stable_s:
            self.restarts = 0
        self.delay_s = min(self.max_s, self.initial_s * 2**self.restarts)
        self.exited_at = now
        return self.delay_s

    def due(self, now: float) -> bool:
        return self.exited_at is not None and now >= self.exited_at + self.delay_s

    def restarted(self, now: float) -> None:
        self.restarts += 1
        self.exited_at = None
        self.started_at = now
