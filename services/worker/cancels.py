"""What a worker remembers of cancels for requests it does not hold (yet). Pure: injected clock.

A cancel can come before its request: the client went away while the request still waited in the
queue. The worker remembers it, with the gateway that sent it, so a request pulled afterwards is
refused instead of generated for nobody. A gateway that gives up one attempt of a request (it
continues elsewhere) names the attempt; an attempt given up before it was pulled is not started.
"""

from __future__ import annotations

from collections.abc import Callable

KEEP_S = 900.0  # longer than a request may wait in the queue in practice
MAX_CANCELS = 100_000
MAX_SUPERSEDED = 10_000


class CancelMemory:
    def __init__(self, clock: Callable[[], float], *, keep_s: float = KEEP_S, max_cancels: int = MAX_CANCELS,
                 max_superseded: int = MAX_SUPERSEDED) -> None:
        self.clock = clock
        self.keep_s = keep_s
        self.max_cancels = max_cancels
        self.max_superseded = max_superseded
        self._cancelled: dict[tuple[str, str], tuple[float, str]] = {}  # (owner, request id) → (when, reason)
        self._superseded: dict[tuple[str, int], None] = {}  # (request id, attempt), oldest first

    def remember(self, owner: str, request_id: str, reason: str) -> None:
        """`owner` (a gateway, or the batch service) cancelled `request_id`, which this worker does not hold."""
        now = self.clock()
        self._cancelled[(owner, request_id)] = (now, reason)
        if len(self._cancelled) > self.max_cancels:
            # Oldest first (dicts keep insertion order): forget what is past its deadline anyway.
            for old in list(self._cancelled)[: len(self._cancelled) // 2]:
                del self._cancelled[old]
        while self._cancelled:
            oldest, (seen, _) = next(iter(self._cancelled.items()))
            if now - seen < self.keep_s:
                break
            del self._cancelled[oldest]

    def reason(self, owner: str, request_id: str) -> str | None:
        """Why `owner` cancelled `request_id` before this worker took it, or None."""
        seen = self._cancelled.get((owner, request_id))
        return None if seen is None else seen[1]

    def supersede(self, request_id: str, attempt: int) -> None:
        """The gateway gave up this attempt before this worker took it."""
        self._superseded[(request_id, attempt)] = None
        while len(self._superseded) > self.max_superseded:
            del self._superseded[next(iter(self._superseded))]

    def superseded(self, request_id: str, attempt: int) -> bool:
        return (request_id, attempt) in self._superseded
