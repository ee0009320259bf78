"""Replays one trace against one controller and the cluster model; summarises SLO, GPU-hours, cost."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from dmtd_contract.stats import percentile
from dmtd_operator.metrics import MetricsWindow
from dmtd_operator.sim.controllers import Controller
from dmtd_operator.sim.model import Cluster, ReplicaModel, StepOutcome
from dmtd_operator.sim.traces import Trace
from dmtd_operator.spec import DMTDDeploymentSpec

HELD_MS = 1e9
"""Latency recorded while no replica is ready (requests held by the gateway)."""


@dataclass(slots=True)
class Timeline:
    """Per-step series for the plot."""

    t_s: list[float] = field(default_factory=list)
    requests_s: list[float] = field(default_factory=list)
    provisioned: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    tau: list[int] = field(default_factory=list)
    ttft_p95_ms: list[float] = field(default_factory=list)
    itl_p95_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Headline numbers of one (trace, policy) run."""

    slo_attainment: float
    gpu_hours: float
    usd_per_1m_tokens: float
    tokens: float
    mean_tau: float
    peak_replicas: int
    replica_changes: int

    def to_dict(self) -> dict[str, float | int]:
        return {
            "slo_attainment": round(self.slo_attainment, 5),
            "gpu_hours": round(self.gpu_hours, 4),
            "usd_per_1m_tokens": round(self.usd_per_1m_tokens, 4),
            "tokens": round(self.tokens),
            "mean_tau": round(self.mean_tau, 3),
            "peak_replicas": self.peak_replicas,
            "replica_changes": self.replica_changes,
        }


def window_of(steps: deque[tuple[float, StepOutcome]], dt_s: float, tau: int) -> MetricsWindow:
    """What Prometheus would report over the buffered steps."""
    outs = [o for _, o in steps]
    finite = [o for o in outs if o.ready > 0]
    ttfts = [min(o.ttft_p95_ms, HELD_MS) for o in outs]
    itls = [min(o.itl_p95_ms, HELD_MS) for o in finite] or [0.0]
    return MetricsWindow(
        window_s=len(outs) * dt_s,
        ttft_p95_ms=percentile(ttfts, 0.95),
        itl_p95_ms=percentile(itls, 0.95),
        queue_depth=outs[-1].queue_requests,
        gpu_util=sum(o.gpu_util for o in outs) / len(outs),
        tok_s=sum(o.served_tok_s for o in outs) / len(outs),
        requests_s=sum(r for r, _ in steps) / len(outs),
        mean_block_len=float(tau),
        ready_replicas=outs[-1].ready,
    )


def run(
    trace: Trace,
    controller: Controller,
    spec: DMTDDeploymentSpec,
    model: ReplicaModel,
    *,
    initial_replicas: int,
    window_s: float = 30.0,
    progress: object | None = None,
) -> tuple[RunSummary, Timeline]:
    """Replay `trace`; the controller is evaluated every `spec.scaling.interval_s`."""
    dt = trace.dt_s
    cluster = Cluster.warm(model, initial_replicas, spec.tau.baseline)
    buffer: deque[tuple[float, StepOutcome]] = deque(maxlen=max(1, int(window_s / dt)))
    every = max(1, round(spec.scaling.interval_s / dt))
    timeline = Timeline()
    met = total = gpu_s = tokens = tau_tokens = 0.0
    peak, changes, provisioned = initial_replicas, 0, initial_replicas
    gpus = max(spec.resources.gpus_per_replica, 1)
    for i, rate in enumerate(trace.requests_s):
        now = i * dt
        out = cluster.step(rate, now, dt)
        buffer.append((rate, out))
        ok = out.ttft_p95_ms <= spec.slo.ttft_p95_ms and out.itl_p95_ms <= spec.slo.itl_p95_ms
        total += rate * dt
        met += rate * dt if ok else 0.0
        gpu_s += out.provisioned * gpus * dt
        tokens += out.served_tok_s * dt
        tau_tokens += out.served_tok_s * dt * cluster.tau
        timeline.t_s.append(now)
        timeline.requests_s.append(rate)
        timeline.provisioned.append(out.provisioned)
        timeline.ready.append(out.ready)
        timeline.tau.append(cluster.tau)
        timeline.ttft_p95_ms.append(min(out.ttft_p95_ms, 10 * spec.slo.ttft_p95_ms))
        timeline.itl_p95_ms.append(min(out.itl_p95_ms, 10 * spec.slo.itl_p95_ms))
        if (i + 1) % every == 0:
            replicas, tau = controller.evaluate(window_of(buffer, dt, cluster.tau), now + dt)
            if replicas != provisioned:
                changes += 1
            cluster.set_replicas(replicas, now + dt)
            cluster.tau = tau
            provisioned = replicas
            peak = max(peak, replicas)
        if progress is not None and hasattr(progress, "update"):
            progress.update(1)
    gpu_hours = gpu_s / 3600.0
    usd = gpu_hours * spec.cost.usd_per_gpu_hour
    summary = RunSummary(
        slo_attainment=met / total if total else 1.0,
        gpu_hours=gpu_hours,
        usd_per_1m_tokens=usd / (tokens / 1e6) if tokens else math.inf,
        tokens=tokens,
        mean_tau=tau_tokens / tokens if tokens else float(spec.tau.baseline),
        peak_replicas=peak,
        replica_changes=changes,
    )
    return summary, timeline
