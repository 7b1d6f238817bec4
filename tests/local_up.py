"""`inferbus up` in a child process, as an operator runs it, for tests that drive the whole platform
through its CLI (drills, supervision)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def inferbus_up(state: Path, *args: str, ready_within_s: float) -> Iterator[Path]:
    """Run `inferbus up ARGS --state-dir STATE` until it says it is serving; yield STATE, then stop it
    as Ctrl-C does. The platform is the child's own: the test's NATS_URL and REDIS_URL are not passed."""
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    up = subprocess.Popen(
        [sys.executable, "-m", "tools.commands.main", "up", *args, "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + ready_within_s
        while not any("Press Ctrl-C" in line for line in lines):
            assert up.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        yield state
    finally:
        up.send_signal(2)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
