"""What a worker remembers of cancels for requests it does not hold yet (pure, injected clock)."""

from __future__ import annotations

from services.worker.cancels import CancelMemory


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_cancel_is_remembered_for_its_gateway_until_it_is_old() -> None:
    clock = Clock()
    memory = CancelMemory(clock, keep_s=10.0)
    memory.remember("gw-a", "r1", "client_disconnected")
    assert memory.reason("gw-a", "r1") == "client_disconnected"
    assert memory.reason("gw-b", "r1") is None  # another gateway's request of the same id
    clock.now = 11.0
    memory.remember("gw-a", "r2", "deadline")  # remembering forgets what is past keep_s
    assert memory.reason("gw-a", "r1") is None and memory.reason("gw-a", "r2") == "deadline"


def test_the_memory_is_bounded() -> None:
    memory = CancelMemory(Clock(), max_cancels=4, max_superseded=2)
    for i in range(5):
        memory.remember("gw", f"r{i}", "x")
    assert memory.reason("gw", "r0") is None and memory.reason("gw", "r4") == "x"
    for attempt in range(3):
        memory.supersede("r", attempt)
    assert not memory.superseded("r", 0) and memory.superseded("r", 1) and memory.superseded("r", 2)
    assert not memory.superseded("other", 1)
