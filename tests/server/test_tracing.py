"""--otlp-endpoint: each request's span reaches an OTLP/HTTP collector (a small one here, decoding what it gets
with OpenTelemetry's own protobuf classes), as a child of the client's traceparent."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server import tracing
from loraplex.server.app import create_app


@pytest.fixture
def collector():
    received: list[ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path == "/v1/traces":
                received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def spans(received):
    return [span for request in received for resource in request.resource_spans
            for scope in resource.scope_spans for span in scope.spans]


def test_each_request_is_a_span_under_the_clients_trace(collector, embedded, monkeypatch):
    endpoint, received = collector
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.setattr(tracing, "_provider", None)
    tracing.configure_tracing(endpoint)
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with TestClient(create_app(AsyncEngine(engine))) as client:
        response = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
                               headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert response.status_code == 200
        assert client.get("/no/such/route").status_code == 404
    tracing.flush()
    by_name = {span.name: span for span in spans(received)}
    generate = by_name["POST /generate"]
    assert generate.trace_id.hex() == trace_id and generate.parent_span_id.hex() == "00f067aa0ba902b7"
    attributes = {a.key: a.value for a in generate.attributes}
    assert attributes["http.response.status_code"].int_value == 200
    assert attributes["loraplex.generated_tokens"].int_value == 3
    assert generate.end_time_unix_nano > generate.start_time_unix_nano
    assert "GET /no/such/route" in by_name
