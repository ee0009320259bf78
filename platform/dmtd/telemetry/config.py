"""Telemetry settings of a serving process: tracing exporter and sampling, the metrics port, prices.

Built from the Serve application's args (``telemetry_settings(args)``) with the standard OpenTelemetry
environment variables as fallbacks, so a KubeRay pod can be pointed at a collector without a new config.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

Exporter = Literal["memory", "console", "otlp", "none"]

# Illustrative on-demand list prices ($ per accelerator-hour); override per deployment with ``prices``.
DEFAULT_PRICES: dict[str, float] = {
    "cpu": 0.10,  # a 2-vCPU CPU-only replica, priced as one "GPU" unit
    "t4": 0.35,
    "l4": 0.80,
    "a10g": 1.01,
    "a100-80gb": 1.79,
    "h100": 2.99,
    "h200": 3.79,
}


class TelemetrySettings(BaseModel):
    """What a serving process exports and where."""

    deployment: str = Field(default="local", description="`deployment` label on every series (the DMTDDeployment name)")
    trace_exporter: Exporter = Field(
        default="memory", description="memory: a bounded in-process buffer (tests, the dashboard); console: stdout; "
        "otlp: OTLP/HTTP to `otlp_endpoint`; none: no spans")
    otlp_endpoint: str | None = Field(
        default=None, description="OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces")
    trace_sample_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0, description="fraction of new traces sampled (parent-based)")
    trace_buffer_spans: int = Field(default=4096, ge=16, description="spans the memory exporter keeps")
    metrics_port: int | None = Field(default=9464, description="Prometheus port of the gateway; None: no endpoint")
    replica_metrics_port: int | None = Field(
        default=None, description="first Prometheus port tried by replicas (default: metrics_port; "
        "busy ports are skipped)")
    metrics_host: str = Field(default="127.0.0.1", description="address the Prometheus endpoints bind")
    replica_type: str = Field(default="cpu", description="key into `prices`")
    usd_per_gpu_hour: float | None = Field(default=None, ge=0,
                                           description="explicit price per accelerator-hour (wins over `prices`)")
    gpus_per_replica: int = Field(default=1, ge=0, description="accelerators a replica holds (0 counts as 1 CPU unit)")
    prices: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_PRICES),
                                     description="$ per accelerator-hour by replica type")
    ttft_slo_ms: float = Field(default=2000.0, gt=0, description="TTFT SLO for the SLO-compliance counter")
    itl_slo_ms: float = Field(default=50.0, gt=0, description="per-token ITL p95 SLO for the SLO-compliance counter")

    @field_validator("prices")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        if any(p < 0 for p in v.values()):
            raise ValueError("prices must be >= 0")
        return v

    @property
    def gpu_hour_price(self) -> float:
        """$ per accelerator-hour of this replica type."""
        if self.usd_per_gpu_hour is not None:
            return self.usd_per_gpu_hour
        if self.replica_type not in self.prices:
            raise ValueError(f"replica_type {self.replica_type!r} has no price (known: {sorted(self.prices)})")
        return self.prices[self.replica_type]

    @property
    def usd_per_replica_hour(self) -> float:
        return self.gpu_hour_price * max(1, self.gpus_per_replica)

    def replica_port(self) -> int | None:
        return self.replica_metrics_port if self.replica_metrics_port is not None else self.metrics_port


def telemetry_settings(args: dict[str, Any], env: dict[str, str] | None = None) -> TelemetrySettings:
    """Settings from Serve app args (keys as the fields, or a nested ``telemetry`` dict) and OTEL_* env."""
    env = dict(os.environ) if env is None else env
    raw: dict[str, Any] = {k: args[k] for k in TelemetrySettings.model_fields if args.get(k) is not None}
    raw.update(args.get("telemetry") or {})
    if "otlp_endpoint" not in raw and env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        raw["otlp_endpoint"] = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    elif "otlp_endpoint" not in raw and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        raw["otlp_endpoint"] = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    if "trace_exporter" not in raw and raw.get("otlp_endpoint"):
        raw["trace_exporter"] = "otlp"
    if "trace_sample_ratio" not in raw and env.get("OTEL_TRACES_SAMPLER_ARG"):
        raw["trace_sample_ratio"] = float(env["OTEL_TRACES_SAMPLER_ARG"])
    if "deployment" not in raw and env.get("DMTD_DEPLOYMENT"):
        raw["deployment"] = env["DMTD_DEPLOYMENT"]
    return TelemetrySettings.model_validate(raw)
