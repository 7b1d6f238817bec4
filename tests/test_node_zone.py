"""A pod's zone in Kubernetes: `inferbus node-zone` (the gateway's and workers' `zone` init container)
reads its node's topology.kubernetes.io/zone label from the Kubernetes API and writes it where the
service reads it (INFERBUS_ZONE_FILE).

The API is a small local HTTPS server answering GET /api/v1/nodes/NAME as the real one does: a
Node object, 403 to a token it does not know (the real API's answer to a ServiceAccount without
the `get nodes` grant), 404 to an unknown node; the command runs as the init container runs it,
with the token and CA in a ServiceAccount directory and KUBERNETES_SERVICE_HOST/PORT set."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from inferbus.local.tls import make_local_tls
from inferbus.runtime.node_zone import ZONE_LABEL, read_zone, zone_of_node
from inferbus.runtime.settings import load
from services.gateway.settings import GatewaySettings
from services.worker.settings import WorkerSettings

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TOKEN = "pod-token"  # noqa: S105 (a test's)
NODES = {
    "gpu-node-1": {ZONE_LABEL: "eu-west-1b", "kubernetes.io/hostname": "gpu-node-1"},
    "old-node": {"failure-domain.beta.kubernetes.io/zone": "eu-west-1c"},
    "bare-node": {"kubernetes.io/hostname": "bare-node"},
}


class FakeApiServer(ThreadingHTTPServer):
    def __init__(self, cert: Path, key: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.paths: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.paths.append(self.path)
        name = self.path.removeprefix("/api/v1/nodes/")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            status, body = 403, {"kind": "Status", "reason": "Forbidden", "code": 403}
        elif not self.path.startswith("/api/v1/nodes/") or name not in NODES:
            status, body = 404, {"kind": "Status", "reason": "NotFound", "code": 404}
        else:
            status, body = 200, {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": NODES[name]}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeApiServer, Path]]:
    """The API server and a ServiceAccount directory (token, ca.crt) that trusts it."""
    tls = make_local_tls(tmp_path / "tls", hosts=("127.0.0.1",))
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN + "\n")
    shutil.copy(tls.ca_file, account / "ca.crt")
    server = FakeApiServer(tls.cert_file, tls.key_file)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server, account
    finally:
        server.shutdown()
        server.server_close()


def node_zone(server: FakeApiServer, account: Path, out: Path, node: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(server.server_address[1]),
        "NODE_NAME": node,
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run([sys.executable, "-m", "tools.commands.main", "node-zone", "--out", str(out),
                           "--service-account-dir", str(account), "--tries", "1"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_the_zone_label_of_a_node() -> None:
    assert zone_of_node({"metadata": {"labels": NODES["gpu-node-1"]}}) == "eu-west-1b"
    assert zone_of_node({"metadata": {"labels": NODES["old-node"]}}) == "eu-west-1c"  # before Kubernetes 1.17
    assert zone_of_node({"metadata": {"labels": NODES["bare-node"]}}) == ""
    assert zone_of_node({"metadata": {}}) == ""


def test_the_init_container_writes_its_nodes_zone_and_the_services_read_it(
        api: tuple[FakeApiServer, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server, account = api
    out = tmp_path / "zone" / "zone"
    done = node_zone(server, account, out, "gpu-node-1")
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "eu-west-1b\n" and server.paths == ["/api/v1/nodes/gpu-node-1"]
    monkeypatch.delenv("INFERBUS_ZONE", raising=False)
    monkeypatch.setenv("INFERBUS_ZONE_FILE", str(out))
    assert load(WorkerSettings).resolved().zone == "eu-west-1b"  # in its heartbeats
    assert load(GatewaySettings).resolved_zone() == "eu-west-1b"  # in its placement requests
    monkeypatch.setenv("INFERBUS_ZONE", "us-east-1a")  # an explicit zone wins
    assert load(WorkerSettings).resolved().zone == "us-east-1a"


def test_a_node_without_a_zone_label_gives_no_zone(api: tuple[FakeApiServer, Path], tmp_path: Path) -> None:
    server, account = api
    out = tmp_path / "zone"
    done = node_zone(server, account, out, "bare-node")
    assert done.returncode == 0, done.stderr
    assert "running without a zone" in done.stdout and read_zone("", str(out)) == ""


def test_without_the_grant_or_trust_the_pod_does_not_start(api: tuple[FakeApiServer, Path], tmp_path: Path) -> None:
    server, account = api
    out = tmp_path / "zone"
    (account / "token").write_text("a-token-without-the-cluster-role\n")
    refused = node_zone(server, account, out, "gpu-node-1")
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr and "get nodes" in refused.stderr
    (account / "token").write_text(TOKEN)
    assert node_zone(server, account, out, "no-such-node").returncode == 1
    other_ca = make_local_tls(tmp_path / "other", hosts=("127.0.0.1",))
    shutil.copy(other_ca.ca_file, account / "ca.crt")  # an API server the pod's CA did not sign
    untrusted = node_zone(server, account, out, "gpu-node-1")
    assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    assert not out.exists()


def test_a_zone_file_that_cannot_be_read_stops_the_service(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="INFERBUS_ZONE_FILE"):
        read_zone("", str(tmp_path / "missing"))
    assert read_zone("", "") == ""
