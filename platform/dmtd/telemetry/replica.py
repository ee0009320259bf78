"""Telemetry of a DMTD replica: a span per request (child of the gateway's), engine metrics, cost.

Plain values in, no engine or Serve types: the replica's engine loop calls these hooks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from dmtd.telemetry.config import TelemetrySettings
from dmtd.telemetry.instruments import Instruments, Labels
from dmtd.telemetry.prometheus import MetricsEndpoint
from dmtd.telemetry.system import CpuSampler, NvmlSampler
from dmtd.telemetry.tracing import Tracing, extract, setup_tracing, trace_ids
from dmtd_contract import metric_names as m

log = logging.getLogger("dmtd.replica.requests")


@dataclass(slots=True)
class ReplicaState:
    """What the gauges read at scrape time."""

    queue_depth: int = 0
    batch_size: int = 0
    kv_occupancy: float = 0.0
    prefix_hit_ratio: float = 0.0
    tau: int = 1
    tau_min: int = 1
    tau_max: int = 1
    min_confidence: float = 0.0


@dataclass(slots=True)
class _Req:
    span: trace.Span
    request_id: str
    gpu_s: float = 0.0
    prefilled: bool = False


class ReplicaTelemetry:
    """Spans, metrics and the cost meter of one replica process."""

    def __init__(self, settings: TelemetrySettings, replica: str, variant: str, state: Callable[[], ReplicaState],
                 serve_metrics: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.replica, self.variant = settings, replica, variant
        self.tracing: Tracing = setup_tracing(settings, "dmtd-replica", {"dmtd.replica": replica,
                                                                         "dmtd.variant": variant})
        port = settings.replica_port() if serve_metrics else None
        self.endpoint = MetricsEndpoint("dmtd-replica", port, settings.metrics_host)
        self.ins = Instruments(self.endpoint, "replica",
                               {"deployment": settings.deployment, "variant": variant, "replica": replica})
        self.state, self.clock = state, clock
        self.started = clock()
        self.cpu, self.gpu = CpuSampler(), NvmlSampler()
        self.usd_per_hour = settings.usd_per_replica_hour
        self.gpu_units = max(1, settings.gpus_per_replica)
        self.requests: dict[str, _Req] = {}
        self._observe()

    @property
    def metrics_url(self) -> str | None:
        return self.endpoint.url

    def _observe(self) -> None:
        def one(value: float) -> Iterable[tuple[float, Labels]]:
            return [(value, {})]

        s = self.state
        self.ins.observe(m.QUEUE_DEPTH, lambda: one(s().queue_depth))
        self.ins.observe(m.BATCH_SIZE, lambda: one(s().batch_size))
        self.ins.observe(m.KV_CACHE_OCCUPANCY, lambda: one(s().kv_occupancy))
        self.ins.observe(m.PREFIX_CACHE_HIT_RATIO, lambda: one(s().prefix_hit_ratio))
        self.ins.observe(m.TAU, lambda: one(s().tau))
        self.ins.observe(m.TAU_MIN, lambda: one(s().tau_min))
        self.ins.observe(m.TAU_MAX, lambda: one(s().tau_max))
        self.ins.observe(m.MIN_CONFIDENCE, lambda: one(s().min_confidence))
        self.ins.observe(m.CPU_UTILIZATION, lambda: one(self.cpu.utilization()))
        if self.gpu.available:
            self.ins.observe(m.GPU_UTILIZATION, lambda: one(self.gpu.utilization()))
            self.ins.observe(m.GPU_MEMORY_USED_BYTES, lambda: one(self.gpu.memory_used_bytes()))
        self.ins.observe(m.COST_USD_PER_HOUR, lambda: [(self.usd_per_hour,
                                                        {"replica_type": self.settings.replica_type})])
        self.ins.observe(m.COST_USD_TOTAL, lambda: one(self.cost_usd()))

    def cost_usd(self) -> float:
        """Dollars since start: uptime x price (an idle replica costs as much as a busy one)."""
        return (self.clock() - self.started) / 3600.0 * self.usd_per_hour

    # -- request lifecycle ------------------------------------------------------------------------------------
    def on_arrival(self, request_id: str, traceparent: str, attributes: dict[str, Any]) -> None:
        span = self.tracing.tracer.start_span(
            "dmtd.replica.generate", context=extract(traceparent), kind=trace.SpanKind.SERVER,
            attributes={"dmtd.request_id": request_id, "dmtd.replica": self.replica, "dmtd.variant": self.variant,
                        **attributes})
        self.requests[request_id] = _Req(span, request_id)

    def on_admit(self, request_id: str, prompt_tokens: int, tau: int, min_confidence: float,
                 queue_ms: float, replica_queue_ms: float | None = None) -> None:
        """Admitted to the engine: ``queue_ms`` since the gateway received it, ``replica_queue_ms`` since it
        reached this replica (tokenising the prompt included)."""
        r = self.requests.get(request_id)
        if r is not None:
            r.span.add_event("admitted", {"prompt_tokens": prompt_tokens, "tau": tau,
                                          "min_confidence": min_confidence, "queue_ms": queue_ms})
            if replica_queue_ms is not None:
                r.span.set_attribute("dmtd.stage.replica_queue_ms", replica_queue_ms)

    def on_step(self, kind: str, wall_s: float, rows: list[tuple[str, int]]) -> None:
        """One engine step over ``rows`` (request id, τ): its accelerator time is shared evenly among them,
        and its cost is booked to each row's τ."""
        self.ins.add(m.ENGINE_STEPS_TOTAL, 1, kind=kind)
        share = wall_s * self.gpu_units / max(1, len(rows))
        usd_by_tau: dict[int, float] = {}
        for rid, tau in rows:
            usd_by_tau[tau] = usd_by_tau.get(tau, 0.0) + share / self.gpu_units / 3600.0 * self.usd_per_hour
            r = self.requests.get(rid)
            if r is None:
                continue
            r.gpu_s += share
            if kind == "prefill" and not r.prefilled:
                r.prefilled = True
                r.span.add_event("prefill", {"step_ms": wall_s * 1e3, "batch": len(rows)})
        for tau, usd in usd_by_tau.items():
            self.ins.add(m.BUSY_COST_USD_TOTAL, usd, tau=str(tau))

    def on_loop_restart(self) -> None:
        self.ins.add(m.ENGINE_LOOP_RESTARTS_TOTAL, 1)

    def on_tokens(self, num_heads: int, num_tails: int) -> None:
        self.ins.add(m.HEAD_STEPS_TOTAL, num_heads)
        self.ins.add(m.TAIL_STEPS_TOTAL, num_tails)

    def on_block(self, request_id: str, k: int, tau: int, block_index: int, cut: bool, confidence_min: float,
                 block_ms: float) -> None:
        if k > 0:
            self.ins.add(m.GENERATED_TOKENS_TOTAL, k)
            self.ins.record(m.BLOCK_LENGTH, k, tau=str(tau))
        if cut:
            self.ins.add(m.CYCLES_CUT_TOTAL, 1)
        r = self.requests.get(request_id)
        if r is not None:
            r.span.add_event("block", {"index": block_index, "k": k, "tau": tau, "cut": cut,
                                       "confidence_min": confidence_min, "block_ms": block_ms})

    def on_checked(self, num_drafted: int, num_accepted: int) -> None:
        """A verified cycle's check (exact profile): ``num_drafted`` drafts, the first ``num_accepted`` of them
        accepted and streamed. Cycles that drafted nothing are no cycles here."""
        if num_drafted <= 0:
            return
        self.ins.add(m.DRAFTED_TOKENS_TOTAL, num_drafted)
        self.ins.add(m.ACCEPTED_TOKENS_TOTAL, num_accepted)
        self.ins.record(m.ACCEPTED_PER_CYCLE, num_accepted)
        for j in range(1, num_drafted + 1):
            position = str(min(j, m.MAX_DRAFT_POSITION))
            self.ins.add(m.DRAFTED_BY_POSITION_TOTAL, 1, position=position)
            # 0 too: a drafted position has an accepted series, so its acceptance reads 0, not "no data"
            self.ins.add(m.ACCEPTED_BY_POSITION_TOTAL, int(j <= num_accepted), position=position)

    def on_finish(self, request_id: str, reason: str, usage: dict[str, Any] | None = None,
                  error: str | None = None) -> None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return
        usage = usage or {}
        self.ins.record(m.REQUEST_GPU_SECONDS, r.gpu_s)
        r.span.add_event("finish", {"reason": reason, "gpu_seconds": r.gpu_s,
                                    **{k: v for k, v in usage.items() if isinstance(v, int | float)}})
        r.span.set_attribute("dmtd.finish_reason", reason)
        r.span.set_attribute("dmtd.gpu_seconds", r.gpu_s)
        r.span.set_attribute("dmtd.cost_usd", r.gpu_s / self.gpu_units / 3600.0 * self.usd_per_hour)
        if error or reason in ("error",):
            r.span.set_status(trace.StatusCode.ERROR, error or reason)
        trace_id, span_id = trace_ids(r.span)
        log.info("request finished", extra={"request_id": request_id, "trace_id": trace_id, "span_id": span_id,
                                            "variant": self.variant, "replica": self.replica,
                                            "finish_reason": reason, "gpu_seconds": round(r.gpu_s, 6), **usage})
        r.span.end()

    def finished_spans(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        return self.tracing.finished_spans(trace_id)

    def shutdown(self) -> None:
        for rid in list(self.requests):
            self.on_finish(rid, "abort")
        self.endpoint.shutdown()
        self.tracing.shutdown()
