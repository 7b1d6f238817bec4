"""OpenTelemetry: one trace per request across gateway → worker → engine.

Trace context travels in NATS message headers (`traceparent`, `tracestate`) and in the HTTP
headers of the worker's call to the engine. Spans are recorded only when an exporter is set
(`INFERBUS_OTEL_EXPORTER=console|otlp`); with `none` the context is still propagated, so a
client's own `traceparent` reaches the engine at no cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider

_configured = False


def provider(service: str, exporter: str) -> TracerProvider:
    """A tracer provider exporting spans of `service` with `exporter` (console or otlp).

    `otlp` speaks OTLP/HTTP with protobuf bodies (POST {endpoint}/v1/traces), configured by the
    standard variables: OTEL_EXPORTER_OTLP_ENDPOINT (a collector's HTTP port is 4318; 4317 is its
    gRPC port, which this exporter cannot talk to), OTEL_EXPORTER_OTLP_HEADERS, ..._TIMEOUT.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    span_exporter: SpanExporter
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
    else:
        raise SystemExit(f"unknown INFERBUS_OTEL_EXPORTER {exporter!r}: use none, console or otlp")
    result = TracerProvider(resource=Resource.create({"service.name": f"inferbus-{service}"}))
    result.add_span_processor(BatchSpanProcessor(span_exporter))
    return result


def configure(service: str, exporter: str = "none") -> None:
    global _configured
    if _configured or exporter == "none":
        return
    trace.set_tracer_provider(provider(service, exporter))
    _configured = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current trace context (empty when there is none)."""
    carrier: dict[str, str] = headers if headers is not None else {}
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


@contextmanager
def span(tracer_: trace.Tracer, name: str, incoming: Mapping[str, str] | None) -> Iterator[dict[str, str]]:
    """A span continuing the context in `incoming` headers; yields the headers to send onward.

    With no exporter and no incoming context there is nothing to record or carry, so the hot
    path skips the span machinery altogether.
    """
    if not _configured and not (incoming and "traceparent" in incoming):
        yield {}
        return
    with tracer_.start_as_current_span(name, context=extract(incoming)):
        yield inject()
