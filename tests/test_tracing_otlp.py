"""INFERBUS_OTEL_EXPORTER=otlp exports spans over OTLP/HTTP: a local receiver gets the protobuf POST.

Also: the deployments point the exporter at the collector's HTTP port, and the gateway's latency
histograms carry bounded model/adapter/band labels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from inferbus.runtime import tracing

REPO = Path(__file__).resolve().parents[1]


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: stores each POST's path, content type and body."""

    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: list[tuple[str, str, bytes]] = []
    handler = type("Handler", (_Receiver,), {"received": received})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", received
    finally:
        server.shutdown()
        server.server_close()


def test_otlp_exporter_posts_protobuf_spans(receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    endpoint, received = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    provider = tracing.provider("gateway", "otlp")
    try:
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("gateway.chat") as span:
            span.set_attribute("inferbus.request_id", "req-1")
            trace_id = span.get_span_context().trace_id
        assert provider.force_flush(timeout_millis=10_000)
    finally:
        provider.shutdown()
    assert received, "the receiver got no export"
    path, content_type, body = received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    export = ExportTraceServiceRequest.FromString(body)
    resource = export.resource_spans[0].resource
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "inferbus-gateway"
    spans = [s for rs in export.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["gateway.chat"]
    assert int.from_bytes(spans[0].trace_id, "big") == trace_id
    assert {a.key: a.value.string_value for a in spans[0].attributes}["inferbus.request_id"] == "req-1"


def test_unknown_exporter_is_refused() -> None:
    with pytest.raises(SystemExit, match="none, console or otlp"):
        tracing.provider("gateway", "jaeger")


def test_deployments_point_otlp_at_the_http_port() -> None:
    configmap = yaml.safe_load((REPO / "deploy" / "k8s" / "base" / "configmap.yaml").read_text())
    endpoint = urlparse(configmap["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.scheme == "http" and endpoint.port == 4318  # OTLP/HTTP; 4317 is gRPC


def test_latency_labels_are_bounded() -> None:
    from proto.bands import INTERACTIVE
    from services.gateway import metrics

    assert metrics.latency_labels("llama", None, INTERACTIVE[0]) == ("llama", "base", INTERACTIVE[0])
    # Adapter names are per tenant (unbounded): only whether one served the request is a label.
    assert metrics.latency_labels("llama", "tenant-a/my-adapter", "premium")[1] == "lora"
    assert metrics.latency_labels("llama", None, "made-up-band")[2] == "other"
    assert metrics.TTFT._labelnames == ("model", "adapter", "band")
