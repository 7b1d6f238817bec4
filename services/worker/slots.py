"""How much work a worker may pull: never more unacked or running requests than engine slots."""

from __future__ import annotations


class SlotBudget:
    """Pure accounting of a worker's request slots shared by several pull loops.

    A pull loop reserves slots before it asks the server for messages, so outstanding pull
    requests plus running requests never exceed capacity. Each loop gets at most a fair share,
    so an idle consumer's long-poll cannot hold every slot while another consumer has work.
    """

    def __init__(self, capacity: int, pullers: int) -> None:
        if capacity < 1 or pullers < 1:
            raise ValueError("capacity and pullers must be positive")
        self.capacity = capacity
        self.pullers = pullers
        self.used = 0  # reserved for pending pulls + running

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def reserve(self, want: int) -> int:
        """Take up to `want` slots (0 if none is free)."""
        share = max(1, self.capacity // self.pullers)
        granted = max(0, min(want, share, self.free))
        self.used += granted
        return granted

    def take(self, want: int) -> int:
        """Take up to `want` slots whatever the fair share (the pull plan shares them out)."""
        granted = max(0, min(want, self.free))
        self.used += granted
        return granted

    def take_unreserved(self) -> None:
        """Count a message that arrived without a reservation (a pull request from before a
        reconnect): it runs anyway, so it holds a slot, even past capacity for a moment."""
        self.used += 1

    def release(self, n: int = 1) -> None:
        if n < 0 or n > self.used:
            raise ValueError(f"releasing {n} slots with {self.used} in use")
        self.used -= n
