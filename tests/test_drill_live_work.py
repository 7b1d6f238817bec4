"""`inferbus drill` breaks workers at a moment their engines hold requests: `freeze_while_busy`
stops them (SIGSTOP) and keeps them stopped only once their engine is seen holding requests."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tools.drill.run import Platform, freeze_while_busy

from .waiting import wait_for

pytestmark = pytest.mark.slow


class Engine:
    """A stand-in engine's `/v1/loads`: how many requests it holds, and how often it was asked."""

    def __init__(self) -> None:
        self.holding = 0
        self.asked = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                engine.asked += 1
                body = json.dumps({"loads": [{"num_running_reqs": engine.holding, "num_waiting_reqs": 0}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Platform, Engine, subprocess.Popen[bytes]]]:
    engine = Engine()
    worker = subprocess.Popen(["sleep", "60"])
    (tmp_path / "platform.json").write_text(json.dumps({
        "processes": {"worker-1": worker.pid, "engine-1": 0}, "details": {"engine-1": engine.url}}))
    try:
        yield Platform(tmp_path), engine, worker
    finally:
        worker.kill()
        worker.wait()
        engine.server.shutdown()


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_worker_whose_engine_holds_requests_is_stopped_at_once(setup) -> None:
    platform, engine, worker = setup
    engine.holding = 2
    assert freeze_while_busy(platform, ["worker-1"], timeout_s=5) == 2
    assert wait_for(lambda: state(worker.pid) == "T", timeout=5)


def test_an_idle_worker_is_let_go_until_its_engine_holds_requests(setup) -> None:
    platform, engine, worker = setup
    frozen: list[int] = []
    thread = threading.Thread(target=lambda: frozen.append(freeze_while_busy(platform, ["worker-1"], timeout_s=30)))
    thread.start()
    wait_for(lambda: engine.asked >= 5, timeout=10)  # looked several times, found it idle
    assert not frozen
    engine.holding = 1
    thread.join(timeout=10)
    assert frozen == [1] and state(worker.pid) == "T"


def test_an_engine_idle_to_the_end_leaves_the_worker_running(setup) -> None:
    platform, engine, worker = setup
    assert freeze_while_busy(platform, ["worker-1"], timeout_s=0.3) == 0
    assert state(worker.pid) in ("S", "R")
