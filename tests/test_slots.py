import pytest

from services.worker.slots import SlotBudget


def test_pulls_never_exceed_capacity_and_are_shared_fairly() -> None:
    budget = SlotBudget(capacity=8, pullers=4)
    grants = [budget.reserve(100) for _ in range(4)]
    assert grants == [2, 2, 2, 2]
    assert budget.reserve(1) == 0 and budget.free == 0
    budget.release(3)
    assert budget.reserve(100) == 2 and budget.reserve(100) == 1 and budget.reserve(100) == 0


def test_release_more_than_reserved_is_a_bug() -> None:
    budget = SlotBudget(capacity=2, pullers=1)
    budget.reserve(1)
    with pytest.raises(ValueError):
        budget.release(2)


def test_small_capacity_still_lets_every_puller_ask_for_one() -> None:
    budget = SlotBudget(capacity=2, pullers=4)
    assert [budget.reserve(5) for _ in range(3)] == [1, 1, 0]
