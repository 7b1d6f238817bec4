"""Free ports for the local platform's servers, chosen before any of them starts."""

from __future__ import annotations

import os
import random
import socket

# Below Linux's ephemeral range (32768-60999): a port the kernel hands out for "any free port"
# is also what it hands the next outgoing connection, which then beats our server to it.
# INFERBUS_PORTS ("low-high") narrows it: two processes that start servers side by side (CI's
# drills beside the SGLang contract suite) each probe their own ports and never hand out one the
# other has handed out and not bound yet.
DEFAULT_PORTS = range(20000, 32000)


def port_range(value: str | None) -> range:
    """The ports of INFERBUS_PORTS ("low-high", both included), or DEFAULT_PORTS when unset."""
    if not value:
        return DEFAULT_PORTS
    low, sep, high = value.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit() or not 1024 <= int(low) < int(high) <= 65535:
        raise ValueError(f"INFERBUS_PORTS must be 'low-high' with 1024 <= low < high <= 65535, not {value!r}")
    return range(int(low), int(high) + 1)


_LISTEN_PORTS = port_range(os.environ.get("INFERBUS_PORTS"))


# Ports this process has handed out: a port is free when probed but taken only when its server
# starts, so without this two calls before either server binds could return the same port.
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and this process has not handed out before, from outside the
    ephemeral range where we can."""
    if len(_handed_out) > len(_LISTEN_PORTS) // 2:
        _handed_out.clear()  # a long-lived process: the oldest servers have long bound theirs
    for _ in range(50):
        port = random.choice(_LISTEN_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
