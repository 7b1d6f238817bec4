"""Ports for local servers: a port handed out is not handed out again while its server starts."""

import importlib

import pytest

from inferbus.local import ports
from inferbus.local.ports import free_port


def test_ports_handed_out_before_their_servers_bind_are_all_different() -> None:
    # Nothing binds them here, as in a stack whose ports are all chosen before any server starts.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < 32000 for port in ports)


def test_inferbus_ports_narrows_the_ports_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two suites that start servers side by side (CI) each get their own range.
    monkeypatch.setenv("INFERBUS_PORTS", "26000-26099")
    narrowed = importlib.reload(ports)
    try:
        handed = {narrowed.free_port() for _ in range(40)}
        assert all(26000 <= port <= 26099 for port in handed)
    finally:
        monkeypatch.delenv("INFERBUS_PORTS")
        importlib.reload(ports)


@pytest.mark.parametrize("value", ["26000", "26000-", "b-c", "30000-20000", "80-90", "60000-70000"])
def test_a_malformed_port_range_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="INFERBUS_PORTS"):
        ports.port_range(value)


def test_no_port_range_is_the_default() -> None:
    assert ports.port_range(None) == ports.port_range("") == range(20000, 32000)
