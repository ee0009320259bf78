"""Telemetry of the gateway: the request span (the trace's root, or the caller's child), client-side
latency metrics (TTFT, per-token ITL, end to end), SLO compliance, live dashboard statistics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from dmtd.telemetry.config import TelemetrySettings
from dmtd.telemetry.instruments import Instruments
from dmtd.telemetry.live import LiveStats
from dmtd.telemetry.prometheus import MetricsEndpoint
from dmtd.telemetry.tracing import Tracing, extract, inject, setup_tracing, trace_ids
from dmtd_contract import metric_names as m
from dmtd_contract.stats import percentile

log = logging.getLogger("dmtd.gateway.requests")


class GatewayTelemetry:
    """Spans, metrics and live statistics of the gateway process."""

    def __init__(self, settings: TelemetrySettings, serve_metrics: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings, self.clock = settings, clock
        self.tracing: Tracing = setup_tracing(settings, "dmtd-gateway")
        self.endpoint = MetricsEndpoint("dmtd-gateway", settings.metrics_port if serve_metrics else None,
                                        settings.metrics_host)
        self.ins = Instruments(self.endpoint, "gateway", {"deployment": settings.deployment})
        self.live = LiveStats()
        self.inflight = 0
        self.replicas_ready: dict[str, int] = {}
        self.ins.observe(m.INFLIGHT, lambda: [(self.inflight, {})])
        self.ins.observe(m.REPLICAS_READY, lambda: [(sum(self.replicas_ready.values()), {})])

    @property
    def metrics_url(self) -> str | None:
        return self.endpoint.url

    def start(self, variant: str, request_id: str, traceparent: str | None = None,
              attributes: dict[str, Any] | None = None) -> RequestTelemetry:
        return RequestTelemetry(self, variant, request_id, traceparent, attributes or {})

    def rejected(self, variant: str, code: str) -> None:
        """A request refused before it started (bad input, unknown variant, capacity)."""
        self.ins.add(m.REQUESTS_TOTAL, 1, variant=variant or "", code=code)

    def usd_per_hour(self) -> dict[str, float]:
        return {v: n * self.settings.usd_per_replica_hour for v, n in self.replicas_ready.items()}

    def stats(self) -> dict[str, Any]:
        """What the dashboard polls."""
        return {"deployment": self.settings.deployment, "inflight": self.inflight,
                "replicas_ready": dict(self.replicas_ready), "replica_type": self.settings.replica_type,
                "usd_per_replica_hour": self.settings.usd_per_replica_hour,
                "slo": {"ttft_ms": self.settings.ttft_slo_ms, "itl_ms": self.settings.itl_slo_ms},
                **self.live.snapshot(self.usd_per_hour())}


class RequestTelemetry:
    """One request at the gateway: call ``block`` per block streamed to the client, then ``finish``."""

    def __init__(self, g: GatewayTelemetry, variant: str, request_id: str, traceparent: str | None,
                 attributes: dict[str, Any]) -> None:
        self.g, self.variant, self.request_id = g, variant, request_id
        self.span = g.tracing.tracer.start_span(
            "dmtd.gateway.generate", context=extract(traceparent), kind=trace.SpanKind.SERVER,
            attributes={"dmtd.request_id": request_id, "dmtd.variant": variant, **attributes})
        self.t0 = g.clock()
        self.t_last: float | None = None
        self.ttft_s: float | None = None
        self.tokens = 0
        self.itl_ms: list[float] = []
        self.done = False
        self.replica = ""
        self.stages: dict[str, float] = {}  # ms per stage, summed over the request (span attributes at finish)
        g.inflight += 1
        self.span.add_event("admission", {"variant": variant, "inflight": g.inflight})

    @property
    def traceparent(self) -> str:
        return inject(self.span)

    @property
    def trace_id(self) -> str:
        return trace_ids(self.span)[0]

    def stage(self, name: str, ms: float) -> None:
        """Add ``ms`` to this request's time in stage ``name`` (``dmtd.stage.<name>_ms`` on the span)."""
        self.stages[name] = self.stages.get(name, 0.0) + ms

    def cycle(self, k: int, tau: int, replica: str = "", num_drafted: int = 0, num_accepted: int = 0) -> None:
        """A replica block (one DMTD cycle) arrived: the τ and k histograms of the dashboard, and the drafts of
        a verified cycle."""
        self.g.live.block(self.variant, k, tau, num_drafted, num_accepted)
        self.replica = replica or self.replica

    def delivered(self, k: int) -> None:
        """A block of ``k`` tokens is on its way to the client: TTFT, then k per-token ITL observations."""
        now = self.g.clock()
        ins, lab = self.g.ins, {"variant": self.variant}
        if self.t_last is None:
            self.ttft_s = now - self.t0
            ins.record(m.TTFT_SECONDS, self.ttft_s, **lab)
            self.g.live.first_token(self.variant, self.ttft_s * 1e3)
            self.span.add_event("first_block", {"ttft_ms": self.ttft_s * 1e3, "k": k, "replica": self.replica})
        elif k > 0:
            per_token = (now - self.t_last) / k
            ins.record_n(m.ITL_SECONDS, per_token, k, lab)
            self.itl_ms.extend([per_token * 1e3] * k)
            self.g.live.itl(self.variant, per_token * 1e3, k)
        self.t_last = now
        self.tokens += k

    def finish(self, code: str = "OK", error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        g, lab = self.g, {"variant": self.variant}
        g.inflight -= 1
        e2e_s = (self.t_last or g.clock()) - self.t0
        ok = code == "OK"
        slo_ok = ok and self.ttft_s is not None and self.ttft_s * 1e3 <= g.settings.ttft_slo_ms \
            and percentile(self.itl_ms, 0.95) <= g.settings.itl_slo_ms
        g.ins.add(m.REQUESTS_TOTAL, 1, code=code, **lab)
        if ok:
            g.ins.record(m.E2E_SECONDS, e2e_s, **lab)
            g.ins.add(m.SLO_REQUESTS_TOTAL, int(slo_ok), **lab)
            g.live.finished(self.variant, slo_ok)
        self.span.add_event("finish", {"code": code, "tokens": self.tokens, "e2e_ms": e2e_s * 1e3,
                                       "slo_ok": slo_ok})
        self.span.set_attribute("dmtd.tokens", self.tokens)
        for name, ms in self.stages.items():
            self.span.set_attribute(f"dmtd.stage.{name}_ms", ms)
        if not ok:
            self.span.set_status(trace.StatusCode.ERROR, error or code)
        trace_id, span_id = trace_ids(self.span)
        log.info("request finished", extra={
            "request_id": self.request_id, "trace_id": trace_id, "span_id": span_id, "variant": self.variant,
            "code": code, "tokens": self.tokens, "e2e_ms": round(e2e_s * 1e3, 3),
            "ttft_ms": round(self.ttft_s * 1e3, 3) if self.ttft_s is not None else None, "slo_ok": slo_ok})
        self.span.end()
