"""How many of a gateway's requests may wait in the shared queue at once. Pure: no I/O, no clock.

Under contention requests wait in the gateway's fair queue, not first-come-first-served in
JetStream; only a window of them is published ahead of the workers. The window is the fleet's free
slots (idle capacity is never withheld) and at least `per_worker` per live worker, so a slot that
frees always finds work. A request counts against the window from its publication until a worker
accepts it (or it ends).
"""

from __future__ import annotations


class QueueWindow:
    def __init__(self, per_worker: int = 2) -> None:
        if per_worker < 1:
            raise ValueError("per_worker must be >= 1")
        self.per_worker = per_worker
        self.in_queue = 0  # this gateway's requests published and not yet accepted
        self._by_band: dict[str, int] = {}

    def size(self, live_workers: int, free_slots: int) -> int:
        return max(self.per_worker * max(1, live_workers), free_slots)

    def room(self, live_workers: int, free_slots: int) -> int:
        """How many more requests may be published now."""
        return max(0, self.size(live_workers, free_slots) - self.in_queue)

    def entered(self, band: str) -> None:
        """A request of `band` was published (or published again, migrating)."""
        self.in_queue += 1
        self._by_band[band] = self._by_band.get(band, 0) + 1

    def left(self, band: str) -> None:
        """A published request of `band` was accepted by a worker, or ended first."""
        self.in_queue -= 1
        self._by_band[band] = self._by_band.get(band, 0) - 1

    def queued(self, band: str) -> int:
        """Requests of `band` published and not yet accepted."""
        return self._by_band.get(band, 0)
