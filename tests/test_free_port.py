"""Ports for local servers: a port handed out is not handed out again while its server starts."""

from inferbus.local.ports import free_port


def test_ports_handed_out_before_their_servers_bind_are_all_different() -> None:
    # Nothing binds them here, as in a stack whose ports are all chosen before any server starts.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < 32000 for port in ports)
