"""`inferbus up`, as a user runs it: status lines, a working demo key, Ctrl-C stops everything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from inferbus.local.ports import free_port

from .conftest import MODEL
from .waiting import read_until_api_key

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not reaped it yet.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_up_serves_the_demo_key_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
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
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 90
        key = read_until_api_key(up, lines, deadline)
        assert key, "".join(lines)
        output = "".join(lines)
        for service in ("nats", "redis", "router", "engine-1", "worker-1", "gateway"):
            assert re.search(rf"✓ {service}\s+ready", output), output
        assert f"http://127.0.0.1:{port}/v1" in output
        # The web console's URL, printed before the key, opens its sign-in page.
        console = re.search(r"Console:\s+(http://\S+)", output)
        assert console and console.group(1) == f"http://127.0.0.1:{port}/console/", output
        assert "Sign in" in httpx.get(console.group(1), follow_redirects=True).text

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage and reply.usage.completion_tokens == 3

        children = [int(pid) for pid in re.findall(r"pid (\d+)", output)]
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=30)
        assert up.returncode == 0, rest
        assert "stopped" in rest
        assert not [pid for pid in children if _alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
