"""One child process of the local platform (started in its own session with a private log and
umask, signalled, waited for, restarted on its own backoff), and the order a platform's processes
start in and how long each may take to stop (pure)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferbus.local.private_files import CHILD_UMASK, private_dir
from inferbus.runtime.supervise import Backoff


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready: Callable[[], bool]
    detail: str = ""
    popen: subprocess.Popen[bytes] | None = None
    backoff: Backoff = field(default_factory=Backoff)
    # The command of each start, when it is not the same every time (a prefill engine's bootstrap port).
    command: Callable[[], list[str]] | None = None

    def start(self) -> None:
        if self.command is not None:
            self.argv = self.command()
        private_dir(self.log_path.parent)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # logs hold tenants' ids and request details
        log = os.fdopen(fd, "ab")
        # Own process group: Ctrl-C in the terminal reaches `up`, which then stops children in order.
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            umask=CHILD_UMASK,
        )
        log.close()

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

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


# A platform starts in waves, each ready before the next starts.
START_WAVES = 3


def start_wave(name: str) -> int:
    """The wave the process `name` starts in: 0, NATS, Redis and the sentinels; 1, the auth callout
    (before anyone else connects); 2, every service."""
    if name.split("-")[0] in ("nats", "redis", "sentinel"):
        return 0
    if name.startswith("auth-callout"):
        return 1
    return 2


# Exits a service may have while the platform starts before the start fails: a Kubernetes pod that
# exits is restarted too. A JetStream call can time out while a new cluster still elects its leaders
# (seen: a gateway's first bucket lookup, in a 3-zone start right after another platform's tests).
START_RESTARTS = 3


def restart_in_start_up(name: str, restarts: int) -> bool:
    """Whether the process `name`, exited while the platform starts after `restarts` restarts then,
    is started again (else the start fails): services are, a few times; NATS, Redis and the
    sentinels are not (a server that cannot start says why at once)."""
    return start_wave(name) > 0 and restarts < START_RESTARTS


def stop_grace_s(name: str, timeout: float) -> float:
    """How long the process `name` may take to stop after SIGTERM before it is killed: workers drain
    (`timeout`); the autoscaler drains and stops the workers it started (45 s at least)."""
    if name == "autoscaler":
        return max(timeout, 45)
    if name.startswith("worker"):
        return timeout
    return 5
