"""Zone preference in placement: stay in the asking gateway's zone while it has room, spill across
zones when it is full or gone."""

import random

import pytest

from proto import messages as m
from services.router.config import RoutingConfig
from services.router.placement import make_placer
from services.router.policies import POLICY_NAMES


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, zone: str, max_running: int = 4) -> m.Heartbeat:
    return m.Heartbeat(
        worker_id=worker_id, model="m", engine_url="", started=0, ts=0, max_running=max_running, zone=zone
    )


def load(worker_id: str, running: int) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker_id, model="m", ts=0, seq=1, running=running, waiting=0, in_flight=running,
                        max_running=4, kv_used_tokens=0, kv_capacity_tokens=1000)


def ask(zone: str) -> m.PlacementRequest:
    return m.PlacementRequest(request_id="r", model="m", prompt_tokens=10, zone=zone)


def fleet(policy: str, clock: Clock):  # type: ignore[no-untyped-def]
    placer = make_placer(policy, clock, RoutingConfig(heartbeat_ttl_s=3), random.Random(1))
    for worker, zone in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c")):
        placer.registry.on_heartbeat(beat(worker, zone))
        placer.registry.on_load(load(worker, 0))
    return placer


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_zone_with_room_keeps_its_requests(policy: str) -> None:
    placer = fleet(policy, Clock())
    picks = {placer.place(ask("a")).worker_id for _ in range(6)}  # 8 slots in zone a
    assert picks <= {"a1", "a2"}
    assert {placer.place(ask("b")).worker_id for _ in range(3)} == {"b1"}


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_full_zone_spills_to_the_others(policy: str) -> None:
    placer = fleet(policy, Clock())
    for worker in ("a1", "a2"):
        placer.registry.on_load(load(worker, 4))  # every slot of zone a taken
    picks = [placer.place(ask("a")).worker_id for _ in range(4)]
    assert set(picks) & {"b1", "c1"}, picks


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_lost_zone_spills_and_a_request_without_zone_goes_anywhere(policy: str) -> None:
    clock = Clock()
    placer = fleet(policy, clock)
    clock.now += 2
    for worker in ("b1", "c1"):  # zone a's workers stop beating
        placer.registry.on_heartbeat(beat(worker, worker[0]))
    clock.now += 2
    assert {placer.place(ask("a")).worker_id for _ in range(4)} <= {"b1", "c1"}
    clock.now = 100.0
    placer = fleet(policy, clock)
    assert len({placer.place(ask("")).worker_id for _ in range(40)}) > 1


def test_own_placements_fill_a_zone_before_it_spills() -> None:
    placer = fleet("least_loaded", Clock())
    picks = [placer.place(ask("b")).worker_id for _ in range(5)]
    assert picks[:4] == ["b1"] * 4  # b1's four slots, counted from this router's own placements
    assert picks[4] != "b1"
