"""The engine image check: the digest the kubelet reports for the engine container, read from the
pod's status over the Kubernetes API's HTTP interface, against the release's pinned image."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from services.worker import engine_image

PINNED = "lmsysorg/sglang@sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


def pod(image_id: str, sidecar: bool = True) -> dict[str, Any]:
    """A pod as `GET /api/v1/namespaces/<ns>/pods/<name>` returns it (the fields read here)."""
    engine = {"name": "sglang", "image": "lmsysorg/sglang:v0.5.23-cu129", "imageID": image_id, "ready": True}
    worker = {"name": "worker", "image": "inferbus:0.1.0", "imageID": "docker.io/library/inferbus@" + OTHER}
    status = {"initContainerStatuses": [engine], "containerStatuses": [worker]} if sidecar else {
        "containerStatuses": [engine, worker]}
    return {"kind": "Pod", "metadata": {"name": "worker-7c9f-abcde", "namespace": "inferbus"}, "status": status}


def test_the_running_digest_is_the_kubelets_image_id_of_the_engine_container() -> None:
    # containerd reports `<repo>@sha256:…`, Docker-based runtimes `docker-pullable://<repo>@sha256:…`.
    assert (
        engine_image.running_digest(pod("docker.io/lmsysorg/sglang@sha256:" + "ab" * 32), "sglang")
        == "sha256:" + "ab" * 32
    )
    assert (
        engine_image.running_digest(pod("docker-pullable://lmsysorg/sglang@" + OTHER, sidecar=False), "sglang") == OTHER
    )
    with pytest.raises(engine_image.ImageCheckError, match="no container 'engine'.*sglang, worker"):
        engine_image.running_digest(pod("x@" + OTHER), "engine")
    with pytest.raises(engine_image.ImageCheckError, match="no image digest"):
        engine_image.running_digest(pod(""), "sglang")  # still pulling


def test_a_running_image_other_than_the_releases_is_named() -> None:
    assert engine_image.problem(PINNED, "sha256:" + "ab" * 32) is None
    found = engine_image.problem(PINNED, OTHER)
    assert found is not None and OTHER in found and PINNED in found


class _Api(BaseHTTPRequestHandler):
    served: dict[str, Any] = {}
    status = 200
    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
        type(self).seen.append((self.path, self.headers.get("authorization")))
        body = json.dumps(self.served if self.status == 200 else {"kind": "Status", "code": self.status}).encode()
        self.send_response(self.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Api.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slow
def test_the_worker_reads_its_own_pod_and_checks_the_engine_image(api: str) -> None:
    access = engine_image.PodAccess(api, "inferbus", "worker-7c9f-abcde", token="sa-token", ca_file=None)
    _Api.status, _Api.served = 200, pod("docker.io/lmsysorg/sglang@sha256:" + "ab" * 32)
    assert asyncio.run(engine_image.check("auto", PINNED, "sglang", access)) is None
    assert _Api.seen[-1] == ("/api/v1/namespaces/inferbus/pods/worker-7c9f-abcde", "Bearer sa-token")
    _Api.served = pod("docker.io/lmsysorg/sglang@" + OTHER)
    assert "the engine runs image " + OTHER in (
        asyncio.run(engine_image.check("kubernetes", PINNED, "sglang", access)) or ""
    )
    # Not allowed to read the pod: `auto` serves and logs it unverified, `kubernetes` refuses.
    _Api.status = 403
    assert asyncio.run(engine_image.check("auto", PINNED, "sglang", access)) is None
    with pytest.raises(engine_image.ImageCheckError, match="grant the worker's ServiceAccount `get` on pods"):
        asyncio.run(engine_image.check("kubernetes", PINNED, "sglang", access))


def test_outside_kubernetes_the_image_is_unverified_unless_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert engine_image.pod_access() is None
    assert asyncio.run(engine_image.check("auto", PINNED, "sglang", None)) is None
    assert asyncio.run(engine_image.check("off", PINNED, "sglang", None)) is None
    with pytest.raises(engine_image.ImageCheckError, match="not in a pod"):
        asyncio.run(engine_image.check("kubernetes", PINNED, "sglang", None))
