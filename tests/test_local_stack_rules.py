"""The local launcher's pure decisions: how many workers must serve before the platform does, the
autoscaler's settings, the waves processes start in and how long each may take to stop."""

from __future__ import annotations

import json
from pathlib import Path

from inferbus.bus.auth import Identity
from inferbus.local.process import START_RESTARTS, START_WAVES, restart_in_start_up, start_wave, stop_grace_s
from inferbus.local.stack_config import LOCAL_AUTOSCALER_WINDOWS, StackConfig, autoscaler_env

STATE = Path("/state")


def test_the_platform_serves_once_its_static_workers_or_the_autoscalers_first_are_seen() -> None:
    assert StackConfig(STATE, workers=3).serving_workers_needed() == 3
    assert StackConfig(STATE, prefill=1, decode=2).serving_workers_needed() == 3
    assert StackConfig(STATE, workers=3, autoscale=True, min_workers=2).serving_workers_needed() == 2
    assert StackConfig(STATE, autoscale=True, prefill=1, decode=2, max_workers=3).serving_workers_needed() == 3
    assert StackConfig(STATE, autoscale=True, min_workers=0).serving_workers_needed() == 0


def test_the_autoscaler_gets_its_bounds_the_engine_spec_and_the_workers_identity() -> None:
    config = StackConfig(STATE, autoscale=True, min_workers=1, max_workers=4, gpu="A100", tp=1, model="m",
                         time_scale=2.0, engine_args=["--x"])
    env = autoscaler_env(config, Identity("w", "pw", "worker"), {})
    assert (env["INFERBUS_AUTOSCALER_ACTUATOR"], env["INFERBUS_AUTOSCALER_MIN_SERVING"],
            env["INFERBUS_AUTOSCALER_MAX_SERVING"]) == ("local", "1", "4")
    assert env["INFERBUS_AUTOSCALER_LOCAL_LOG_DIR"] == str(STATE / "logs")
    assert json.loads(env["INFERBUS_AUTOSCALER_LOCAL_ENGINE"]) == {
        "gpu": "A100", "tp": 1, "model": "m", "time_scale": 2.0, "fixed_step_ms": None, "engine_args": ["--x"]}
    assert (env["INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_USER"],
            env["INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_PASSWORD"]) == ("w", "pw")
    assert "INFERBUS_AUTOSCALER_DISAGGREGATED" not in env
    # An outside NATS: the workers' credentials come from the environment.
    assert "INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_USER" not in autoscaler_env(config, None, {})


def test_a_disaggregated_autoscaler_bounds_each_pool() -> None:
    env = autoscaler_env(StackConfig(STATE, autoscale=True, prefill=1, decode=2, max_workers=3), None, {})
    assert env["INFERBUS_AUTOSCALER_DISAGGREGATED"] == "true"
    assert (env["INFERBUS_AUTOSCALER_MIN_SERVING"], env["INFERBUS_AUTOSCALER_PREFILL_MIN_SERVING"],
            env["INFERBUS_AUTOSCALER_PREFILL_MAX_SERVING"]) == ("2", "1", "3")


def test_short_local_windows_yield_to_the_environment_and_explicit_settings_win() -> None:
    defaults = dict(LOCAL_AUTOSCALER_WINDOWS)
    config = StackConfig(STATE, autoscale=True, extra_env={"INFERBUS_AUTOSCALER_DOWN_STEP_S": "30"},
                         autoscaler_env={"INFERBUS_AUTOSCALER_COLD_START_S": "7"})
    env = autoscaler_env(config, None, {"INFERBUS_AUTOSCALER_TICK_S": "5"})
    assert "INFERBUS_AUTOSCALER_TICK_S" not in env  # the launcher's environment reaches the child as it is
    assert "INFERBUS_AUTOSCALER_DOWN_STEP_S" not in env  # extra_env reaches every child
    assert env["INFERBUS_AUTOSCALER_SCALE_DOWN_WINDOW_S"] == defaults["INFERBUS_AUTOSCALER_SCALE_DOWN_WINDOW_S"]
    assert env["INFERBUS_AUTOSCALER_COLD_START_S"] == "7"


def test_infrastructure_starts_first_then_the_callout_then_the_services() -> None:
    names = ["nats", "nats-a", "redis-b", "sentinel-c", "auth-callout", "auth-callout-a", "router", "router-a",
             "billing", "engine-1", "worker-1", "gateway-a", "autoscaler"]
    assert [start_wave(name) for name in names] == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert max(start_wave(name) for name in names) == START_WAVES - 1


def test_workers_drain_the_autoscaler_drains_its_own_and_the_rest_stop_quickly() -> None:
    assert stop_grace_s("worker-3", 15) == 15
    assert stop_grace_s("autoscaler", 15) == 45
    assert stop_grace_s("autoscaler", 60) == 60
    assert [stop_grace_s(name, 15) for name in ("gateway", "nats", "engine-1", "router-a")] == [5, 5, 5, 5]


def test_a_service_that_exits_while_the_platform_starts_is_started_again_a_few_times_a_server_is_not() -> None:
    for name in ("gateway-c", "worker-1", "router", "auth-callout"):
        assert restart_in_start_up(name, 0) and restart_in_start_up(name, START_RESTARTS - 1)
        assert not restart_in_start_up(name, START_RESTARTS)
    for name in ("nats", "nats-b", "redis-a", "sentinel-c"):
        assert not restart_in_start_up(name, 0)
