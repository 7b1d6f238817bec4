"""Whether a local process is ready: its port answers, its HTTP endpoint says 200, its Redis
answers a ping, or it has written its ready line to its log."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path


def redis_reachable(url: str, timeout: float = 0.5) -> bool:
    from inferbus.runtime import redis_conn

    try:
        return bool(redis_conn.sync_client(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping())
    except Exception:
        return False


def tcp_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def logged(path: Path, marker: bytes) -> bool:
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
