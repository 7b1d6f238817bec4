import random

from proto import messages as m
from services.router.policy import PlacementPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, state: str = "ready") -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=0, ts=0, state=state, max_running=10)  # type: ignore[arg-type]


def load(worker_id: str, running: int, kv: float = 0.0) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker_id, model="m", ts=0, seq=1, running=running, waiting=0, in_flight=running,
                        max_running=10, kv_used_tokens=int(kv * 1000), kv_capacity_tokens=1000)


def ask() -> m.PlacementRequest:
    return m.PlacementRequest(request_id="r", model="m", prompt_tokens=10)


def test_least_loaded_worker_wins_and_own_placements_count_before_the_next_report() -> None:
    clock = Clock()
    policy = PlacementPolicy(clock=clock, temperature=0.001, rng=random.Random(1))
    for w in ("a", "b"):
        policy.on_heartbeat(beat(w))
    policy.on_load(load("a", 5))
    policy.on_load(load("b", 2))
    picks = [policy.place(ask()).worker_id for _ in range(6)]
    assert picks[:3] == ["b", "b", "b"]  # b fills up to a's level from its own placements
    assert set(picks[3:]) == {"a", "b"}


def test_draining_full_dead_and_other_model_workers_are_filtered() -> None:
    clock = Clock()
    policy = PlacementPolicy(clock=clock, heartbeat_ttl_s=3)
    policy.on_heartbeat(beat("draining", state="draining"))
    policy.on_heartbeat(beat("full"))
    policy.on_load(load("full", 0, kv=0.99))
    policy.on_heartbeat(m.Heartbeat(worker_id="other", model="x", engine_url="", started=0, ts=0, max_running=1))
    assert policy.place(ask()).target == "any"
    policy.on_heartbeat(beat("ok"))
    assert policy.place(ask()).worker_id == "ok"
    clock.now += 4
    assert policy.place(ask()).target == "any"
    assert set(policy.expire()) == {"draining", "full", "other", "ok"}
