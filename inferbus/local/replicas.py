"""A simulated replica: an engine and the worker driving it, started the same way by `Stack` and by
the autoscaler's local actuator."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.process import Process


@dataclass(frozen=True)
class EngineSpec:
    """How to start one simulated replica's engine: shared by `Stack` and the autoscaler's
    local actuator, so autoscaled replicas are started exactly like static ones."""

    gpu: str = "H100"
    tp: int = 2
    model: str = "meta-llama/Llama-3.3-70B-Instruct"
    time_scale: float = 1.0
    fixed_step_ms: float | None = None
    engine_args: tuple[str, ...] = ()


def role_engine_args(role: str) -> list[str]:
    """A simulated engine's flags for a prefill/decode role (SGLang's `--disaggregation-mode`): a
    prefill engine's bootstrap server on a free port, a new one on every start.

    A new port, because a decode engine keeps a prefill's rank endpoint per bootstrap address (SGLang's
    connection pool) and forgets it only after two missed `/health` polls, 5 s apart. A simulated
    prefill engine restarts well inside that, on a new endpoint: at the old address the decode
    engines would keep sending their KV destinations to the dead process, and every prompt sent to
    the new one would wait for a destination that never comes. A new pod has a new address; a real
    engine takes minutes to come back, far past the two polls."""
    if role == "prefill":
        return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(free_port())]
    if role == "decode":
        return ["--disaggregation-mode", "decode"]
    return []


def replica_processes(
    index: int, spec: EngineSpec, env: dict[str, str], logs_dir: Path, worker_env: dict[str, str] | None = None,
    kv_events: bool = True, role: str = "aggregated",
) -> tuple[Process, Process]:
    """engine-<index> (a simulated engine on free ports) and worker-<index> driving it; `role`:
    a prefill or decode engine and worker of a disaggregated fleet, or an aggregated one."""
    engine_port, events_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    events = f"tcp://127.0.0.1:{events_port}"

    def command() -> list[str]:
        argv = [sys.executable, "-m", "tools.commands.main", "sim-engine", "--host", "127.0.0.1", "--port",
                str(engine_port), "--gpu", spec.gpu, "--tp", str(spec.tp), "--model", spec.model, "--time-scale",
                str(spec.time_scale),
                # The engine binds (SGLang's "bind": true) and the worker connects: a connecting publisher
                # loses its first batches while the subscription reaches it (libzmq).
                "--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": events, "bind": True}),
                *spec.engine_args, *role_engine_args(role)]
        if spec.fixed_step_ms is not None:
            argv += ["--fixed-step-ms", str(spec.fixed_step_ms)]
        return argv

    engine = Process(f"engine-{index}", command(), dict(env), logs_dir / f"engine-{index}.log",
                     lambda: http_ok(f"{engine_url}/ready"), engine_url, command=command)
    extra = {"INFERBUS_WORKER_ID": f"worker-{index}", "INFERBUS_ENGINE_URL": engine_url, "INFERBUS_METRICS_PORT": "0",
             "INFERBUS_WORKER_ROLE": role}
    if role == "prefill":  # every engine on this machine's loopback: the decode engines reach it there
        extra["INFERBUS_ENGINE_BOOTSTRAP_HOST"] = "127.0.0.1"
    if kv_events:
        extra["INFERBUS_ENGINE_KV_EVENTS"] = events
        extra["INFERBUS_ENGINE_KV_EVENTS_BIND"] = "false"
    worker = Process(f"worker-{index}", [sys.executable, "-m", "tools.commands.main", "worker"],
                     {**env, **extra, **(worker_env or {})}, logs_dir / f"worker-{index}.log",
                     lambda: True, f"drives engine-{index}" + (f" ({role})" if role != "aggregated" else ""))
    return engine, worker
