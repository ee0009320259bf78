"""Prometheus metric names of the platform: the serving side exports exactly these, the operator's
Prometheus source and the Grafana dashboard read exactly these.

Units follow Prometheus conventions (`_seconds`, `_total`, ratios 0..1). Import the constants; never
spell a metric name as a literal elsewhere. `source` says which serving process exports a metric (each
metric comes from exactly one kind of process, so a `sum` over all scraped targets never double counts).
docs/metrics.md documents every name; a test keeps it complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Source = Literal["gateway", "replica"]

GATEWAY_LABELS = ("deployment", "variant")
REPLICA_LABELS = ("deployment", "variant", "replica")
# The `position` label of the exact profile's per-position counters: 1 = the first tail after a cycle's head.
# A cycle has at most tau - 1 <= 15 tails (tau <= 16 in every variant), so the label takes at most 15 values.
MAX_DRAFT_POSITION = 15


@dataclass(frozen=True, slots=True)
class MetricName:
    """One exported metric."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    source: Source = "replica"
    unit: str = ""


# -- gateway: what the client sees -------------------------------------------------------------------------
REQUESTS_TOTAL = MetricName(
    "dmtd_requests_total", "counter", "Requests that reached the gateway, by final gRPC status code.",
    (*GATEWAY_LABELS, "code"), "gateway",
)
SLO_REQUESTS_TOTAL = MetricName(
    "dmtd_slo_compliant_requests_total", "counter",
    "Completed requests that met both the TTFT SLO and the per-token ITL p95 SLO.", GATEWAY_LABELS, "gateway",
)
INFLIGHT = MetricName(
    "dmtd_inflight_requests", "gauge", "Streams in flight at the gateway.", ("deployment",), "gateway",
)
TTFT_SECONDS = MetricName(
    "dmtd_ttft_seconds", "histogram", "Time from request arrival at the gateway to its first token.",
    GATEWAY_LABELS, "gateway", "s",
)
ITL_SECONDS = MetricName(
    "dmtd_itl_seconds", "histogram",
    "Inter-token latency, per generated token (a block of k tokens counts k observations of its gap / k).",
    GATEWAY_LABELS, "gateway", "s",
)
E2E_SECONDS = MetricName(
    "dmtd_end_to_end_seconds", "histogram", "Time from request arrival at the gateway to its last token.",
    GATEWAY_LABELS, "gateway", "s",
)
REPLICAS_READY = MetricName(
    "dmtd_replicas_ready", "gauge", "Replicas the gateway can route to (running, all variants).",
    ("deployment",), "gateway",
)
# -- replica: what the engine does --------------------------------------------------------------------------
GENERATED_TOKENS_TOTAL = MetricName(
    "dmtd_generated_tokens_total", "counter", "Output tokens generated (and streamed).", REPLICA_LABELS,
)
BLOCK_LENGTH = MetricName(
    "dmtd_block_length", "histogram", "Tokens emitted per DMTD cycle (k, 1..tau), by the tau of the cycle.",
    (*REPLICA_LABELS, "tau"),
)
TAU = MetricName("dmtd_tau", "gauge", "The tau the replica's controller has in force.", REPLICA_LABELS)
TAU_MAX = MetricName("dmtd_tau_max", "gauge", "Upper tau bound in force on a replica.", REPLICA_LABELS)
TAU_MIN = MetricName("dmtd_tau_min", "gauge", "Lower tau bound in force on a replica.", REPLICA_LABELS)
MIN_CONFIDENCE = MetricName(
    "dmtd_min_confidence", "gauge", "Confidence gate in force (0 = fixed cycles).", REPLICA_LABELS,
)
CYCLES_CUT_TOTAL = MetricName(
    "dmtd_cycles_cut_total", "counter", "Cycles ended early by the confidence gate (k < tau).", REPLICA_LABELS,
)
HEAD_STEPS_TOTAL = MetricName(
    "dmtd_head_steps_total", "counter", "Token positions decoded as heads (full depth).", REPLICA_LABELS,
)
TAIL_STEPS_TOTAL = MetricName(
    "dmtd_tail_steps_total", "counter", "Token positions decoded as tails (decoding layers only).", REPLICA_LABELS,
)
DRAFTED_TOKENS_TOTAL = MetricName(
    "dmtd_drafted_tokens_total", "counter",
    "Exact profile: tail tokens drafted and checked by the next head (the verifier).", REPLICA_LABELS,
)
ACCEPTED_TOKENS_TOTAL = MetricName(
    "dmtd_accepted_tokens_total", "counter",
    "Exact profile: drafts the verifier accepted (and streamed); with the verifier's own token per cycle they "
    "are the exact requests' output.", REPLICA_LABELS,
)
DRAFTED_BY_POSITION_TOTAL = MetricName(
    "dmtd_drafted_by_position_total", "counter",
    "Exact profile: drafts checked, by tail position in the cycle (1 = the first tail after the head).",
    (*REPLICA_LABELS, "position"),
)
ACCEPTED_BY_POSITION_TOTAL = MetricName(
    "dmtd_accepted_by_position_total", "counter",
    "Exact profile: drafts accepted, by tail position in the cycle (a draft is accepted only if every draft "
    "before it in the cycle was).", (*REPLICA_LABELS, "position"),
)
ACCEPTED_PER_CYCLE = MetricName(
    "dmtd_accepted_per_cycle", "histogram",
    "Exact profile: drafts accepted per verified cycle that drafted (the cycle emits these plus the verifier's "
    "token); mean = _sum / _count.", REPLICA_LABELS,
)
ENGINE_STEPS_TOTAL = MetricName(
    "dmtd_engine_steps_total", "counter", "Batched engine steps, by kind (prefill, decode).",
    (*REPLICA_LABELS, "kind"),
)
ENGINE_LOOP_RESTARTS_TOTAL = MetricName(
    "dmtd_engine_loop_restarts_total", "counter",
    "Times the replica's engine loop ended with an exception and its supervisor started it again.",
    REPLICA_LABELS,
)
QUEUE_DEPTH = MetricName(
    "dmtd_queue_depth", "gauge", "Requests admitted by a replica and waiting for a batch slot.", REPLICA_LABELS,
)
BATCH_SIZE = MetricName("dmtd_batch_size", "gauge", "Sequences in the replica's running batch.", REPLICA_LABELS)
KV_CACHE_OCCUPANCY = MetricName(
    "dmtd_kv_cache_occupancy", "gauge", "Fraction of the replica's KV-cache token capacity in use (0..1).",
    REPLICA_LABELS,
)
PREFIX_CACHE_HIT_RATIO = MetricName(
    "dmtd_prefix_cache_hit_ratio", "gauge",
    "Share of the replica's prompt tokens whose KV came from its prefix cache since it started (0..1).",
    REPLICA_LABELS,
)
ROUTE_DECISIONS_TOTAL = MetricName(
    "dmtd_route_decisions_total", "counter",
    "Requests the gateway routed to a replica, by reason (prefix: the replica holding the longest indexed "
    "prefix; new_prefix: none held, the least loaded; load: the prefix's replica was too busy).",
    (*GATEWAY_LABELS, "reason"), "gateway",
)
GPU_UTILIZATION = MetricName(
    "dmtd_gpu_utilization", "gauge", "Fraction of time the replica's GPU was busy (0..1; NVML, GPU only).",
    REPLICA_LABELS,
)
GPU_MEMORY_USED_BYTES = MetricName(
    "dmtd_gpu_memory_used_bytes", "gauge", "GPU memory in use on the replica's GPU (NVML, GPU only).",
    REPLICA_LABELS,
)
CPU_UTILIZATION = MetricName(
    "dmtd_cpu_utilization", "gauge", "CPU time of the replica process over wall time, per CPU it may use (0..1).",
    REPLICA_LABELS,
)
REQUEST_GPU_SECONDS = MetricName(
    "dmtd_request_gpu_seconds", "histogram",
    "Accelerator-seconds attributed to a request (each step's wall time x GPUs, shared across its batch).",
    REPLICA_LABELS, "replica", "s",
)
COST_USD_PER_HOUR = MetricName(
    "dmtd_cost_usd_per_hour", "gauge", "Price of the replica (GPUs x $/GPU-hour of its replica type).",
    (*REPLICA_LABELS, "replica_type"),
)
COST_USD_TOTAL = MetricName(
    "dmtd_cost_usd_total", "counter", "Dollars the replica has cost since it started (uptime x price).",
    REPLICA_LABELS,
)
BUSY_COST_USD_TOTAL = MetricName(
    "dmtd_busy_cost_usd_total", "counter",
    "Dollars of engine-step time, booked to the tau of each sequence in the step (split evenly per sequence).",
    (*REPLICA_LABELS, "tau"),
)

ALL: tuple[MetricName, ...] = (
    REQUESTS_TOTAL,
    SLO_REQUESTS_TOTAL,
    INFLIGHT,
    TTFT_SECONDS,
    ITL_SECONDS,
    E2E_SECONDS,
    REPLICAS_READY,
    GENERATED_TOKENS_TOTAL,
    BLOCK_LENGTH,
    TAU,
    TAU_MAX,
    TAU_MIN,
    MIN_CONFIDENCE,
    CYCLES_CUT_TOTAL,
    HEAD_STEPS_TOTAL,
    TAIL_STEPS_TOTAL,
    DRAFTED_TOKENS_TOTAL,
    ACCEPTED_TOKENS_TOTAL,
    DRAFTED_BY_POSITION_TOTAL,
    ACCEPTED_BY_POSITION_TOTAL,
    ACCEPTED_PER_CYCLE,
    ENGINE_STEPS_TOTAL,
    ENGINE_LOOP_RESTARTS_TOTAL,
    QUEUE_DEPTH,
    BATCH_SIZE,
    KV_CACHE_OCCUPANCY,
    PREFIX_CACHE_HIT_RATIO,
    ROUTE_DECISIONS_TOTAL,
    GPU_UTILIZATION,
    GPU_MEMORY_USED_BYTES,
    CPU_UTILIZATION,
    REQUEST_GPU_SECONDS,
    COST_USD_PER_HOUR,
    COST_USD_TOTAL,
    BUSY_COST_USD_TOTAL,
)

PREFIX = "dmtd_"
assert all(m.name.startswith(PREFIX) for m in ALL)
assert len({m.name for m in ALL}) == len(ALL)
