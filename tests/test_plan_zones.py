"""N+1 per zone: the spread, what a zone's loss leaves, and where replicas are added or removed."""

import pytest

from inferbus.zones import (
    left_after_zone_loss,
    replicas_for_zone_loss,
    spread,
    survives_zone_loss,
    zone_to_add,
    zone_to_remove,
)


def test_spread_is_even_to_one_replica() -> None:
    assert spread(7, 3) == [3, 2, 2]
    assert spread(6, 3) == [2, 2, 2]
    assert left_after_zone_loss([3, 2, 2]) == 4


@pytest.mark.parametrize("needed", [0.5, 1.0, 2.1, 3.0, 7.3, 20.0, 41.9])
@pytest.mark.parametrize("zones", [2, 3, 4])
def test_the_smallest_fleet_that_survives_a_zone_loss(needed: float, zones: int) -> None:
    n = replicas_for_zone_loss(needed, zones)
    assert survives_zone_loss(spread(n, zones), needed)
    assert not survives_zone_loss(spread(n - 1, zones), needed)


def test_rounding_in_whole_replicas_can_need_more_than_z_over_z_minus_one() -> None:
    # 2.1 replicas needed over 3 zones: ⌈2.1 × 3 ÷ 2⌉ = 4 leaves 2 after losing a zone of 2; 5 leaves 3.
    assert replicas_for_zone_loss(2.1, 3) == 5


def test_replicas_go_to_the_emptiest_zone_and_leave_the_fullest() -> None:
    assert zone_to_add({"a": 2, "b": 1, "c": 2}) == "b"
    assert zone_to_remove({"a": 2, "b": 1, "c": 2}) == "c"
    assert zone_to_add({"a": 1, "b": 1}) == "a"


def test_the_plan_states_the_rule_and_says_when_rounding_falls_short() -> None:
    from tools.capacity.plan.report import _zone_lines

    assert _zone_lines(6, 1, 5.0) == []
    (holds,) = _zone_lines(24, 3, 15.43)
    assert "8 + 8 + 8" in holds and "leaves 16 ≥ the 15.43" in holds
    (short,) = _zone_lines(4, 3, 2.1)  # ⌈2.1 × 3 ÷ 2⌉ = 4 leaves 2: the rule needs 5
    assert "fewer than the 2.10" in short and "needs **5** serving (2 + 2 + 1)" in short


@pytest.mark.slow
def test_inferbus_plan_prints_the_rule_for_the_cheapest_row() -> None:
    from click.testing import CliRunner

    from tools.commands.main import main

    result = CliRunner().invoke(main, ["plan", "--rpm", "6000", "--zones", "3"])
    assert result.exit_code == 0, result.output
    assert "N+1 per zone: spread evenly" in result.output and "losing the largest zone leaves" in result.output
