"""The local actuator keeps replicas spread over zones: a new one goes to the emptiest zone, a
scale-down takes from the fullest."""

from __future__ import annotations

from pathlib import Path

from inferbus.local.replicas import EngineSpec
from services.autoscaler.actuators.local import LocalActuator


def actuator(zones: list[str], placed: dict[str, str]) -> LocalActuator:
    local = LocalActuator(
        {"m": "aggregated"}, EngineSpec(), Path("/tmp"), cold_start_s=0, warm_start_s=0, env={}, zones=zones
    )
    for worker_id, zone in placed.items():
        local.replicas[worker_id] = None  # type: ignore[assignment]  # the bookkeeping alone
        local.zone_of[worker_id] = zone
        local.pool_of[worker_id] = "m"
    return local


def test_scale_down_takes_from_the_fullest_zones_first() -> None:
    local = actuator(["a", "b", "c"], {"w1": "a", "w2": "b", "w3": "c", "w4": "a", "w5": "b"})
    assert local._per_zone("m") == {"a": 2, "b": 2, "c": 1}
    # The policy offers w3 (zone c) first; the spread keeps c's only replica and takes from a and b.
    assert local._spread_order("m", ["w3", "w1", "w2"], 2) == ["w2", "w1"]  # a tie goes to the last zone by name
    assert local._spread_order("m", ["w3"], 1) == ["w3"]  # the policy's choice when it is the only one


def test_without_zones_the_policys_order_is_kept() -> None:
    local = actuator([], {"w1": "", "w2": ""})
    assert local._spread_order("m", ["w2", "w1"], 1) == ["w2"]
