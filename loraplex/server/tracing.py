"""OpenTelemetry traces (`--otlp-endpoint`, LoRAX's flag): one span per HTTP request, exported over OTLP/HTTP.

The span is made from the request's log record when the response ends (request_log.py), so it carries the same
facts: route, status, adapter, tokens, queue and inference time. A W3C `traceparent` header from the client makes
it a child of the client's span. Needs the `otlp` extra (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http).
"""

from __future__ import annotations

_tracer = None
_provider = None


class TracingUnavailable(RuntimeError):
    """--otlp-endpoint was given but the OpenTelemetry packages are not installed."""


def configure_tracing(endpoint: str, service_name: str = "loraplex") -> None:
    """Export spans to the OTLP/HTTP collector at `endpoint` (e.g. http://collector:4318; /v1/traces is added)."""
    global _tracer, _provider
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable("--otlp-endpoint needs OpenTelemetry: pip install 'loraplex[otlp]'") from exc
    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _tracer = _provider.get_tracer("loraplex")


def flush() -> None:
    """Export the spans made so far (tests; shutdown)."""
    if _provider is not None:
        _provider.force_flush()


def record_span(name: str, attributes: dict, failed: bool, start_ns: int, end_ns: int, headers) -> None:
    """One request's span, from its finished log record's facts (no-op unless configure_tracing ran)."""
    if _tracer is None:
        return
    from opentelemetry.trace import Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in headers
               if key in (b"traceparent", b"tracestate")}
    parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
    span = _tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    if failed:
        span.set_status(Status(StatusCode.ERROR))
    span.end(end_time=end_ns)
