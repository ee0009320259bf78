"""The OTLP exporter, pointed at a collector endpoint (a real OTLP/HTTP receiver on loopback), delivers the
spans; the console exporter prints them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from dmtd.telemetry.config import TelemetrySettings, telemetry_settings
from dmtd.telemetry.tracing import extract, inject, setup_tracing


class Collector(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        Collector.received.append(req)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_http_export_reaches_the_collector():
    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = telemetry_settings({}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"})
        assert settings.trace_exporter == "otlp"
        tracing = setup_tracing(settings, "dmtd-gateway")
        parent = tracing.tracer.start_span("dmtd.gateway.generate")
        child = tracing.tracer.start_span("dmtd.replica.generate", context=extract(inject(parent)))
        child.add_event("block", {"k": 3, "tau": 3})
        child.end()
        parent.end()
        tracing.provider.force_flush()
        spans = {s.name: s for r in Collector.received for rs in r.resource_spans for ss in rs.scope_spans
                 for s in ss.spans}
        assert set(spans) == {"dmtd.gateway.generate", "dmtd.replica.generate"}
        assert spans["dmtd.replica.generate"].parent_span_id == spans["dmtd.gateway.generate"].span_id
        assert spans["dmtd.replica.generate"].events[0].name == "block"
        service = {a.key: a.value.string_value for r in Collector.received
                   for a in r.resource_spans[0].resource.attributes}
        assert service["service.name"] == "dmtd-gateway"
        tracing.shutdown()
    finally:
        server.shutdown()


def test_console_exporter_prints_spans(capsys):
    tracing = setup_tracing(TelemetrySettings(trace_exporter="console"), "dmtd-replica")
    tracing.tracer.start_span("dmtd.replica.generate").end()
    tracing.shutdown()
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "dmtd.replica.generate" and out["resource"]["attributes"]["service.name"] == "dmtd-replica"
