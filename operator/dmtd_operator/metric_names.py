"""Prometheus metric names of the platform: the serving side exports exactly these, the operator's
Prometheus source and the Grafana dashboard read exactly these.

Units follow Prometheus conventions (`_seconds`, `_total`, ratios 0..1). Import the constants; never
spell a metric name as a literal elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricName:
    """One exported metric."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


REQUESTS_TOTAL = MetricName(
    "dmtd_requests_total", "counter", "Requests accepted by the gateway.", ("deployment", "variant", "code")
)
QUEUE_DEPTH = MetricName(
    "dmtd_queue_depth", "gauge", "Requests waiting at the gateway for a replica slot.", ("deployment",)
)
TTFT_SECONDS = MetricName(
    "dmtd_ttft_seconds",
    "histogram",
    "Time from request arrival to its first token.",
    ("deployment", "variant"),
)
ITL_SECONDS = MetricName(
    "dmtd_itl_seconds",
    "histogram",
    "Inter-token latency, per generated token (a block of k tokens counts k observations of its gap / k).",
    ("deployment", "variant"),
)
GENERATED_TOKENS_TOTAL = MetricName(
    "dmtd_generated_tokens_total", "counter", "Tokens generated.", ("deployment", "variant", "replica")
)
BLOCK_LENGTH = MetricName(
    "dmtd_block_length", "histogram", "Tokens emitted per DMTD cycle (k, 1..tau).", ("deployment", "variant")
)
TAU_MAX = MetricName(
    "dmtd_tau_max", "gauge", "Upper tau bound in force on a replica.", ("deployment", "replica")
)
TAU_MIN = MetricName(
    "dmtd_tau_min", "gauge", "Lower tau bound in force on a replica.", ("deployment", "replica")
)
GPU_UTILIZATION = MetricName(
    "dmtd_gpu_utilization",
    "gauge",
    "Fraction of time the replica's GPU was busy (0..1).",
    ("deployment", "replica"),
)
BATCH_SIZE = MetricName(
    "dmtd_batch_size", "gauge", "Sequences in the replica's running batch.", ("deployment", "replica")
)
REPLICAS_READY = MetricName(
    "dmtd_replicas_ready", "gauge", "Replicas the gateway can route to.", ("deployment",)
)

ALL: tuple[MetricName, ...] = (
    REQUESTS_TOTAL,
    QUEUE_DEPTH,
    TTFT_SECONDS,
    ITL_SECONDS,
    GENERATED_TOKENS_TOTAL,
    BLOCK_LENGTH,
    TAU_MAX,
    TAU_MIN,
    GPU_UTILIZATION,
    BATCH_SIZE,
    REPLICAS_READY,
)

PREFIX = "dmtd_"
assert all(m.name.startswith(PREFIX) for m in ALL)
