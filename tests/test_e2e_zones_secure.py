"""The 3-zone platform with TLS and the auth callout at once (`inferbus up --zones 3 --tls
--callout`): every NATS node's client port and its cluster routes speak TLS only, with certificates
from the launcher's CA; every service connects with a token of its own, authorized by the callout
of its zone; each service learns its zone from a zone file, as a Kubernetes pod does from its
`zone` init container; and each zone's gateway serves, keeping its requests in its zone."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, running_platform
from .test_e2e_tls import plaintext_exchange

pytestmark = pytest.mark.e2e

ZONES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def secure_zones(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("zones-secure"), zones=3, workers=3, time_scale=0.1, tls=True,
                          callout=True, batch=False) as running:
        yield running


def node_ports(state: Path, zone: str) -> tuple[int, int, int]:
    """(client, monitoring, cluster) ports of the zone's nats-server, from its config."""
    config = (state / f"nats-{zone}.conf").read_text()
    client, cluster = (int(port) for port in re.findall(r'listen: "127\.0\.0\.1:(\d+)"', config))
    monitor = int(re.search(r'http: "127\.0\.0\.1:(\d+)"', config).group(1))  # type: ignore[union-attr]
    return client, monitor, cluster


def route_info(state: Path, port: int, *, with_certificate: bool) -> str:
    """What a TLS client trusting the platform's CA reads first from a cluster port (a route's
    INFO), presenting the nodes' certificate or none."""
    context = ssl.create_default_context(cafile=str(state / "tls" / "ca.pem"))
    if with_certificate:
        context.load_cert_chain(str(state / "tls" / "nats-server.pem"), str(state / "tls" / "nats-server.key"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            context.wrap_socket(sock, server_hostname="127.0.0.1") as route:
        route.settimeout(5)
        data = route.recv(65536)
        if not data:
            raise ConnectionError("closed by the server")
        return data.decode(errors="replace")


def test_every_zone_serves_with_tls_and_callout_identities(secure_zones: Platform) -> None:
    stack = secure_zones.stack
    assert stack.zones == ZONES and stack.nats_server_url.count("tls://") == 3
    for zone, url in stack.gateway_urls.items():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=secure_zones.api_key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {zone}"}],
                                               max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3, zone
    logs = {p.name: p.log_path.read_text(errors="replace") for p in stack.processes}
    for zone in ZONES:  # a callout per zone, each connected to its own zone's node first
        assert '"auth_callout_ready"' in logs[f"auth-callout-{zone}"]
        assert "callout_bad_request" not in logs[f"auth-callout-{zone}"]
    for word in ("Permissions Violation", "Authorization Violation"):
        found = [line for text in logs.values() for line in text.splitlines() if word in line]
        assert found == [], found[:5]
    config = (stack.config.state_dir / "nats-b.conf").read_text()
    assert "auth_callout" in config and stack.identities is not None
    assert stack.identities["gateway-b"].password not in config  # services have no passwords on the bus


def test_client_ports_and_routes_refuse_plaintext(secure_zones: Platform) -> None:
    state = secure_zones.stack.config.state_dir
    ops = secure_zones.stack.identities["ops"]  # type: ignore[index]
    for zone in ZONES:
        client, monitor, cluster = node_ports(state, zone)
        info, answer, closed = plaintext_exchange("127.0.0.1", client, ops.user, ops.password)
        assert '"tls_required":true' in info.replace(" ", ""), (zone, info)
        assert closed and "PONG" not in answer and "+OK" not in answer, (zone, answer, closed)
        # Routes: no word in plaintext; over TLS, only for a peer with a certificate of the CA.
        with socket.create_connection(("127.0.0.1", cluster), timeout=5) as route:
            route.settimeout(1)
            with pytest.raises(TimeoutError):
                route.recv(65536)
        assert route_info(state, cluster, with_certificate=True).startswith("INFO "), zone
        with pytest.raises((ssl.SSLError, ConnectionError)):
            route_info(state, cluster, with_certificate=False)
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/routez", timeout=5) as routez:
            peers = {r["remote_name"] for r in json.loads(routez.read())["routes"]}
        assert peers == {f"nats-{z}" for z in ZONES if z != zone}, (zone, peers)


def test_services_learn_their_zone_from_a_zone_file_and_requests_stay_in_it(secure_zones: Platform) -> None:
    stack = secure_zones.stack
    for zone, index in zip(ZONES, (1, 2, 3), strict=True):
        assert (stack.config.state_dir / "zones" / zone).read_text().strip() == zone
        gateway = stack.get(f"gateway-{zone}")
        ready = [json.loads(line) for line in gateway.log_path.read_text().splitlines() if '"gateway_ready"' in line]
        assert ready and ready[-1]["zone"] == zone
        worker = [json.loads(line) for line in stack.get(f"worker-{index}").log_path.read_text().splitlines()
                  if '"worker_ready"' in line]
        assert worker and worker[-1]["zone"] == zone  # worker-N runs in zone N (in turn)
    # With room in its zone, a gateway's requests go to its zone's worker (the ledger says which).
    ids: dict[str, str] = {}
    for zone in ZONES:
        client = openai.OpenAI(base_url=f"{stack.gateway_urls[zone]}/v1", api_key=secure_zones.api_key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "where"}],
                                               max_tokens=2)
        ids[reply.id.removeprefix("chatcmpl-")] = zone  # the completion's id is made of the request's
    served = asyncio.run(_usage_workers(secure_zones, set(ids)))
    assert {ids[request]: worker for request, worker in served.items()} == {"a": "worker-1", "b": "worker-2",
                                                                            "c": "worker-3"}


async def _usage_workers(platform: Platform, request_ids: set[str]) -> dict[str, str]:
    """request id → the worker its usage event names, read from the USAGE ledger over TLS."""
    stack = platform.stack
    context = ssl.create_default_context(cafile=stack.nats_tls_ca)
    nc = await nats.connect(stack.nats_url.split(","), tls=context, connect_timeout=5)
    found: dict[str, str] = {}
    try:
        for _ in range(20):
            sub = await nc.jetstream().subscribe(subjects.usage_filter("demo"), ordered_consumer=True)
            try:
                while True:
                    event = msgspec.msgpack.decode((await sub.next_msg(timeout=0.5)).data, type=m.UsageEvent)
                    if event.request_id in request_ids:
                        found[event.request_id] = event.worker_id
            except nats.errors.TimeoutError:
                pass
            await sub.unsubscribe()
            if set(found) == request_ids:
                break
    finally:
        await nc.close()
    return found


def test_every_platform_command_works_against_three_zones(secure_zones: Platform, tmp_path: Path) -> None:
    """The CLI against the HA shape: a NATS cluster URL, Redis under Sentinel, TLS and the callout."""
    from .test_cli_local_platform import every_platform_command

    every_platform_command(secure_zones, tmp_path / "exports")
