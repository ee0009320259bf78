"""OpenTelemetry tracing for one serving process: a private TracerProvider, W3C trace-context helpers.

The gateway injects its span's ``traceparent`` into the request dict it sends through Ray; the replica
extracts it, so the replica span is the gateway span's child in the same trace. The ``memory`` exporter
keeps the last N finished spans in process (``finished_spans()``), which tests and the dashboard read.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dmtd.telemetry.config import TelemetrySettings

PROPAGATOR = TraceContextTextMapPropagator()


class RingSpanExporter(SpanExporter):
    """Keeps the last ``capacity`` finished spans (thread-safe)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def shutdown(self) -> None:
        pass


def span_to_dict(s: ReadableSpan) -> dict[str, Any]:
    """A plain, picklable summary of a finished span (ids as W3C hex)."""
    ctx = s.context
    assert ctx is not None
    return {
        "name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
        "kind": s.kind.name, "start_ns": s.start_time, "end_ns": s.end_time,
        "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in s.events],
        "service": str(s.resource.attributes.get("service.name", "")),
    }


class Tracing:
    """A process's tracer with its exporter; build with :func:`setup_tracing`."""

    def __init__(self, provider: TracerProvider, memory: RingSpanExporter | None) -> None:
        self.provider, self.memory = provider, memory
        self.tracer = provider.get_tracer("dmtd")

    def finished_spans(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        """Finished spans held by the memory exporter (all, or one trace's)."""
        if self.memory is None:
            return []
        out = [span_to_dict(s) for s in self.memory.spans()]
        return [s for s in out if trace_id is None or s["trace_id"] == trace_id]

    def shutdown(self) -> None:
        self.provider.shutdown()


def setup_tracing(settings: TelemetrySettings, service: str, attributes: dict[str, str] | None = None) -> Tracing:
    """A private TracerProvider (no global state) exporting as ``settings`` say."""
    resource = Resource.create({"service.name": service, "dmtd.deployment": settings.deployment,
                                **(attributes or {})})
    ratio = settings.trace_sample_ratio if settings.trace_exporter != "none" else 0.0
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(ratio)))
    memory: RingSpanExporter | None = None
    if settings.trace_exporter == "memory":
        memory = RingSpanExporter(settings.trace_buffer_spans)
        provider.add_span_processor(SimpleSpanProcessor(memory))
    elif settings.trace_exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))  # today's stdout
    elif settings.trace_exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    return Tracing(provider, memory)


def inject(span: trace.Span) -> str:
    """The W3C ``traceparent`` of ``span`` ("" when it is not recording a sampled trace)."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def extract(traceparent: str | None) -> otel_context.Context | None:
    """The parent context a ``traceparent`` names (None when absent or malformed)."""
    if not traceparent:
        return None
    ctx = PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def trace_ids(span: trace.Span) -> tuple[str, str]:
    """(trace_id, span_id) as hex; zeros when not sampled."""
    c = span.get_span_context()
    return f"{c.trace_id:032x}", f"{c.span_id:016x}"
