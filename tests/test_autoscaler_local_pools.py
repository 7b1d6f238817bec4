"""The local actuator runs a disaggregated fleet's two pools apart: each pool's replicas are its
role's engine+worker pairs, counted, scaled and retired within that pool only. The pairs here are
real processes (`sleep`), started and stopped as the actuator does its simulated engines."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from inferbus.local.process import Process
from inferbus.local.replicas import EngineSpec
from services.autoscaler.actuators import local as local_actuator
from services.autoscaler.actuators.local import LocalActuator

pytestmark = pytest.mark.slow  # the replicas are real processes

PREFILL, DECODE = "m:prefill", "m:decode"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """worker id → the role its pair was started with."""
    roles: dict[str, str] = {}

    def pair(index: int, spec: EngineSpec, env: dict[str, str], logs_dir: Path,
             worker_env: dict[str, str] | None = None, kv_events: bool = True,
             role: str = "aggregated") -> tuple[Process, Process]:
        roles[f"worker-{index}"] = role
        return (Process(f"engine-{index}", ["sleep", "60"], {}, tmp_path / f"engine-{index}.log", lambda: True),
                Process(f"worker-{index}", ["sleep", "60"], {"INFERBUS_WORKER_ID": f"worker-{index}"},
                        tmp_path / f"worker-{index}.log", lambda: True))

    monkeypatch.setattr(local_actuator, "replica_processes", pair)
    return roles


async def test_each_pool_is_scaled_with_its_roles_replicas_only(started: dict[str, str], tmp_path: Path) -> None:
    local = LocalActuator({PREFILL: "prefill", DECODE: "decode"}, EngineSpec(), tmp_path, cold_start_s=0,
                          warm_start_s=0, drain_timeout_s=0, env={})
    try:
        await local.scale(DECODE, 3)
        await local.scale(PREFILL, 1)
        fleet = (await local.current()).pools
        assert (fleet[PREFILL].replicas, fleet[DECODE].replicas) == (1, 3)
        assert fleet[PREFILL].ids == ("worker-4",) and fleet[DECODE].ids == ("worker-1", "worker-2", "worker-3")
        assert started == {"worker-1": "decode", "worker-2": "decode", "worker-3": "decode", "worker-4": "prefill"}

        # A scale-down of one pool retires that pool's replicas, whatever else is offered.
        await local.scale(DECODE, 1, retire=["worker-4", "worker-3", "worker-2"])
        fleet = (await local.current()).pools
        assert fleet[PREFILL].ids == ("worker-4",) and fleet[DECODE].ids == ("worker-1",)
        await local.scale(PREFILL, 2)
        assert (await local.current()).pools[PREFILL].ids == ("worker-4", "worker-5")
        assert started["worker-5"] == "prefill"

        with pytest.raises(ValueError, match="not 'm'"):
            await local.scale("m", 1)
    finally:
        await local.close()
    assert not local.replicas


def test_up_prints_each_pools_decisions_with_its_role(tmp_path: Path) -> None:
    from tools.commands.autoscaler_log import DecisionTail

    def decision(pool: str, direction: str, warm: int, reason: str) -> str:
        return json.dumps({"event": "scale_decision", "pool": pool, "direction": direction, "desired_warm": warm,
                           "reason": reason, "timestamp": "2026-01-01T10:00:00Z"})

    log = tmp_path / "autoscaler.log"
    log.write_text("\n".join([
        decision(DECODE, "up", 1, "scale up 1→2"),
        decision(PREFILL, "hold", 0, "hold 1"),  # its own warm target has not changed: no line
        decision(DECODE, "hold", 1, "hold 2"),
        json.dumps({"event": "replica_started", "pool": PREFILL, "worker_id": "worker-3", "worker_pid": 7,
                    "timestamp": "2026-01-01T10:00:01Z"}),
        decision("llama3:8b", "up", 0, "scale up 1→2"),
    ]) + "\n")
    lines = [click.unstyle(line) for line in DecisionTail(log).lines()]
    assert lines == [
        " 10:00:00 autoscaler (decode): scale up 1→2",
        " 10:00:01 autoscaler (prefill): worker-3 started (pid 7)",
        " 10:00:00 autoscaler: scale up 1→2",
    ]


def test_up_gives_the_autoscaler_both_pools_and_their_bounds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from inferbus.local.stack import Stack, StackConfig
    from inferbus.runtime.settings import load
    from services.autoscaler.service import make_actuator
    from services.autoscaler.settings import AutoscalerSettings

    env = Stack(StackConfig(state_dir=tmp_path, autoscale=True, prefill=1, decode=2, max_workers=3,
                            model="m")).autoscaler_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INFERBUS_MODEL", "m")
    settings = load(AutoscalerSettings)
    assert [(pool, role) for pool, role, _ in settings.scaled_pools()] == [("m", "prefill"), ("m", "decode")]
    configs = settings.role_configs()
    assert (configs["prefill"].min_serving, configs["prefill"].max_serving, configs["prefill"].max_replicas) == (
        1,
        3,
        3,
    )
    assert (configs["decode"].min_serving, configs["decode"].max_serving, configs["decode"].max_replicas) == (2, 3, 3)
    actuator = make_actuator(settings)
    assert isinstance(actuator, LocalActuator) and actuator.pools == {PREFILL: "prefill", DECODE: "decode"}

    with pytest.raises(ValueError, match="at most max_workers"):
        StackConfig(state_dir=tmp_path, autoscale=True, prefill=4, decode=1, max_workers=3)
