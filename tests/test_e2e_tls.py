"""`inferbus up --tls`, as a user runs it: NATS's client port speaks TLS only, with a certificate
from a CA the launcher made; every service verifies it and the platform serves a chat completion;
a plaintext client, and a TLS client that does not trust that CA, are refused."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import nats
import openai
import pytest

from inferbus.bus.connection import BusSettings
from inferbus.local.ports import free_port
from inferbus.local.stack import PLATFORM_FILE

from .conftest import MODEL
from .waiting import read_until_api_key

pytestmark = pytest.mark.e2e


def plaintext_exchange(host: str, port: int, user: str, password: str) -> tuple[str, str, bool]:
    """(the server's INFO, what it answers, whether it closed the connection) for a client that
    speaks the NATS protocol without TLS (with valid credentials)."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.settimeout(5)
        info = sock.recv(65536).decode(errors="replace")
        assert info.startswith("INFO "), info
        connect = json.dumps({"user": user, "pass": password, "verbose": False, "pedantic": False, "protocol": 1})
        answer, closed = "", False
        try:
            sock.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not closed:
                chunk = sock.recv(65536)
                closed = not chunk
                answer += chunk.decode(errors="replace")
        except TimeoutError:
            pass
        except (ConnectionError, OSError):
            closed = True
        return info, answer, closed


def test_up_with_tls_serves_and_refuses_plaintext(tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "NATS_TLS_CA")}
    up = subprocess.Popen(
        [sys.executable, "-m", "tools.commands.main", "up", "--tls", "--workers", "1", "--port", str(port),
         "--time-scale", "0.1", "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        key = read_until_api_key(up, lines, deadline)
        assert key, "".join(lines)
        while not any(line.lstrip().startswith("TLS:") for line in lines) and time.monotonic() < deadline:
            lines.append(up.stdout.readline())
        output = "".join(lines)
        assert re.search(r"TLS:\s+NATS at tls://127\.0\.0\.1:\d+", output), output

        # Every service reached NATS over TLS (it accepts nothing else): a chat completion is served.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3

        found = json.loads((state / PLATFORM_FILE).read_text())
        url = urllib.parse.urlsplit(found["nats_url"])
        assert url.scheme == "tls" and url.hostname == "127.0.0.1" and url.port
        ca_file = Path(found["nats_tls_ca"])
        assert ca_file.is_file()
        key_file = state / "tls" / "nats-server.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((state / "tls").stat().st_mode) == 0o700
        user, password = found["nats_user"], found["nats_password"]

        # A plaintext client, even with valid credentials, is refused.
        info, answer, closed = plaintext_exchange("127.0.0.1", url.port, user, password)
        assert '"tls_required":true' in info.replace(" ", ""), info
        assert closed and "PONG" not in answer and "+OK" not in answer, (answer, closed)

        async def connect(ca: str | None) -> bool:
            options = BusSettings(user=user, password=password, tls_ca=ca or "").options(found["nats_url"])
            try:
                nc = await nats.connect(found["nats_url"], allow_reconnect=False, max_reconnect_attempts=0,
                                        connect_timeout=5, **options)  # type: ignore[arg-type]
            except Exception:
                return False
            connected = nc.is_connected
            await nc.close()
            return connected

        # The platform's CA is what makes a client trust the server; the system's CAs do not.
        assert asyncio.run(connect(str(ca_file)))
        assert not asyncio.run(connect(None))
        # The CLI run against this platform finds its CA in platform.json (an operator command
        # that reads the ledger over NATS).
        cli = subprocess.run([sys.executable, "-m", "tools.commands.main", "usage", "rebuild", "--yes"],
                             env={**env, "INFERBUS_PLATFORM_DIR": str(state)}, capture_output=True, text=True,
                             timeout=120)
        assert cli.returncode == 0 and "Rebuilt usage rollups" in cli.stdout, cli.stdout + cli.stderr
        with pytest.raises(ssl.SSLCertVerificationError):
            context = ssl.create_default_context()
            with socket.create_connection(("127.0.0.1", url.port), timeout=5) as sock:
                sock.recv(65536)  # the server's INFO, before the TLS upgrade
                with context.wrap_socket(sock, server_hostname="127.0.0.1"):
                    pass
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def test_every_platform_command_works_against_a_tls_platform(tmp_path: Path) -> None:
    """The CLI finds a --tls platform's CA in its state dir and every command answers over TLS."""
    from .conftest import running_platform
    from .test_cli_local_platform import every_platform_command

    with running_platform(tmp_path / "state", workers=1, time_scale=0.1, tls=True) as platform:
        assert platform.stack.nats_url.startswith("tls://")
        every_platform_command(platform, tmp_path / "exports")
        # A CA that did not sign the server's certificate: the command fails at once and says why.
        env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
        env.update(INFERBUS_PLATFORM_DIR=str(platform.stack.config.state_dir), NATS_TLS_CA=str(wrong_ca(tmp_path)))
        for args in (["release", "list"], ["mix", "from-usage", "--since", "1h"]):
            done = subprocess.run([sys.executable, "-m", "tools.commands.main", *args], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 1, done
            assert "cannot reach NATS at tls://" in done.stderr and "NATS_TLS_CA" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr, done.stderr


def wrong_ca(directory: Path) -> Path:
    """The CA certificate of another platform's TLS, made as the launcher makes its own."""
    from inferbus.local.tls import make_local_tls

    return make_local_tls(directory / "other-tls").ca_file
