"""What a worker's engine does in prefill/decode disaggregation, from its /server_info and the
worker's setting. Pure."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

# SGLang's default --disaggregation-bootstrap-port.
DEFAULT_BOOTSTRAP_PORT = 8998


def engine_role(info: dict[str, Any]) -> str:
    """The engine's role: SGLang reports `disaggregation_mode` "null" (aggregated), "prefill" or
    "decode" in /server_info (older engines report nothing: aggregated)."""
    mode = str(info.get("disaggregation_mode") or "null").lower()
    return mode if mode in ("prefill", "decode") else "aggregated"


def resolve_role(setting: str, info: dict[str, Any]) -> str:
    """The worker's role: the engine's, which the setting may name but not contradict (a decode
    worker driving an aggregated engine would send it requests whose KV never comes)."""
    role = engine_role(info)
    if setting not in ("", "auto") and setting != role:
        raise ValueError(f"INFERBUS_WORKER_ROLE is {setting!r} but the engine runs as {role!r} "
                         f"(--disaggregation-mode {info.get('disaggregation_mode') or 'null'})")
    return role


def own_address() -> str:
    """This host's address as others reach it: its name resolved (a pod's IP in Kubernetes)."""
    return socket.gethostbyname(socket.gethostname())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bootstrap_address(info: dict[str, Any], engine_url: str, host_setting: str = "", *,
                      own: Callable[[], str] = own_address) -> tuple[str, int]:
    """Where decode engines reach a prefill engine's bootstrap server: the setting's host, else the
    engine URL's; an engine URL on a loopback address (the engine in the worker's own pod) means
    this host's own address, which other hosts can reach. The port is the engine's
    --disaggregation-bootstrap-port."""
    host = host_setting or urlparse(engine_url).hostname or "127.0.0.1"
    if not host_setting and is_loopback(host):
        host = own()
    port = int(info.get("disaggregation_bootstrap_port") or DEFAULT_BOOTSTRAP_PORT)
    return host, port
