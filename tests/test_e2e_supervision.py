"""`inferbus up` supervises what it started: NATS and a worker killed under load come back on their
own (with a backoff, said in its status output) and requests succeed again without a human."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from inferbus.local.ports import free_port
from inferbus.local.stack import PLATFORM_FILE

from .conftest import MODEL
from .local_up import inferbus_up
from .waiting import wait_for

pytestmark = pytest.mark.e2e


def test_nats_and_a_worker_that_die_are_restarted_and_requests_succeed_again(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.commands.main",
            "up",
            "--workers",
            "1",
            "--port",
            str(port),
            "--time-scale",
            "0.1",
            "--state-dir",
            str(state),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:

        def started() -> bool:
            assert up.poll() is None, "".join(lines)
            return any("API key:" in line for line in lines)

        wait_for(started, 120, interval=0.2, what="inferbus up's API key line")
        key = re.search(r"API key:\s+(ib-\S+)", "".join(lines)).group(1)  # type: ignore[union-attr]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=10)

        def ask() -> int:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=3)
            return reply.usage.completion_tokens if reply.usage else 0

        assert ask() == 3
        pids = json.loads((state / PLATFORM_FILE).read_text())["processes"]
        os.kill(pids["nats"], signal.SIGKILL)
        os.kill(pids["worker-1"], signal.SIGKILL)

        deadline, served, errors = time.monotonic() + 90, 0, []
        while served < 3 and time.monotonic() < deadline:
            try:
                served += ask() == 3
            except openai.APIError as error:
                errors.append(type(error).__name__)
                time.sleep(0.5)
        output = "".join(lines)
        assert served == 3, f"no request succeeded after the kills ({errors[-3:]}):\n{output}"
        for name in ("nats", "worker-1"):
            assert re.search(rf"{name}\s+exited \(code -9\), restarting in \d+ s", output), output
            assert re.search(rf"{name}\s+restarted", output), output
        restarted = json.loads((state / PLATFORM_FILE).read_text())["processes"]
        assert restarted["nats"] != pids["nats"] and restarted["worker-1"] != pids["worker-1"]

        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
        assert up.returncode == 0
        assert not (state / PLATFORM_FILE).exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_a_prefill_engine_that_dies_comes_back_and_serves_the_prompts_of_its_decode_engine(tmp_path: Path) -> None:
    """The launcher restarts a killed prefill engine within a second, on a new bootstrap port (a
    decode engine would otherwise keep the dead process's endpoint, see `role_engine_args`), and its
    worker, which lived on, hands out the new address: the next prompts are computed there."""
    import asyncio

    from tools.commands.local_platform import demo_key

    state = tmp_path / "state"
    port = free_port()
    with inferbus_up(state, "--prefill", "1", "--decode", "1", "--port", str(port), "--time-scale", "0.1",
                     ready_within_s=180):
        platform = json.loads((state / PLATFORM_FILE).read_text())
        key = asyncio.run(demo_key(platform["redis_url"]))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=15)

        def ask() -> int:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=3)
            return reply.usage.completion_tokens if reply.usage else 0

        assert ask() == 3
        os.kill(platform["processes"]["engine-1"], signal.SIGKILL)  # engine-1: the prefill engine

        def restarted() -> bool:
            pids = json.loads((state / PLATFORM_FILE).read_text())["processes"]
            return pids["engine-1"] != platform["processes"]["engine-1"]

        wait_for(restarted, 30, interval=0.2, what="the prefill engine restarted")
        # Each request waits on the prefill engine: a stale bootstrap address would fail or hang it.
        deadline, served, errors = time.monotonic() + 60, 0, []
        while served < 3 and time.monotonic() < deadline:
            try:
                served += ask() == 3
            except openai.APIError as error:
                errors.append(f"{type(error).__name__}: {error}")
                time.sleep(0.5)
        prefill_worker = (state / "logs" / "worker-1.log").read_text()
        decode_worker = (state / "logs" / "worker-2.log").read_text()
        assert served == 3, f"no prompt computed after the prefill engine's restart ({errors[-3:]})"
        assert '"engine_back"' in prefill_worker, prefill_worker[-3000:]
        # Its prompts found no prefill worker meanwhile: the prefill pool's trouble, not the decode GPU's.
        assert '"no_prefill_worker"' in decode_worker and '"gpu_death"' not in decode_worker, decode_worker[-3000:]
