"""A fluid model of a DMTD serving cluster: replicas with a cold start, capacity per tau, a queue.

Per step of `dt` seconds: capacity = ready replicas x tokens/s at the tau in force; the token backlog
grows by demand - capacity; TTFT p95 = prefill (slower under load) + backlog drain time + a queueing
term that explodes as utilisation approaches 1; per-token ITL p95 = the tau=1 ITL divided by the tau
speedup, slowed by batch occupancy. Simple on purpose: it ranks policies, it does not predict a cluster.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dmtd_operator.spec import DEFAULT_TAU_SPEEDUP

P95_OVER_MEAN = 3.0
"""p95/mean of an exponential wait (ln 20)."""


@dataclass(frozen=True, slots=True)
class ReplicaModel:
    """What one replica can do; defaults are illustrative, measured numbers come via --capacity-json."""

    replica_tok_s: float = 2400.0
    tau_speedup: tuple[float, ...] = DEFAULT_TAU_SPEEDUP
    cold_start_s: float = 120.0
    prefill_ms: float = 150.0
    itl_tau1_ms: float = 25.0
    batch_slowdown: float = 0.5
    queue_jitter_ms: float = 40.0
    gpu_util_gain: float = 2.5
    mean_output_tokens: float = 256.0

    def __post_init__(self) -> None:
        if self.replica_tok_s <= 0 or not self.tau_speedup or self.cold_start_s < 0:
            raise ValueError("replica_tok_s > 0, a non-empty tau_speedup and cold_start_s >= 0 are required")

    def speedup(self, tau: int) -> float:
        return self.tau_speedup[min(tau, len(self.tau_speedup)) - 1]

    @staticmethod
    def capacity_from_json(path: str | Path) -> tuple[float, tuple[float, ...]]:
        """(replica tok/s at tau=1, relative speedups) from a JSON file.

        Accepts {"replica_tok_s": 2400, "tau_speedup": [1.0, 1.35, ...]} or
        {"tok_s_by_tau": {"1": 2400, "2": 3240, ...}} (absolute tokens/s per tau).
        """
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        if "tok_s_by_tau" in raw:
            by_tau = {int(k): float(v) for k, v in raw["tok_s_by_tau"].items()}
            taus = sorted(by_tau)
            if taus != list(range(1, len(taus) + 1)):
                raise ValueError(f"tok_s_by_tau needs tau = 1..n, got {taus}")
            base = by_tau[1]
            return base, tuple(by_tau[t] / base for t in taus)
        return float(raw["replica_tok_s"]), tuple(float(x) for x in raw["tau_speedup"])


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step of the cluster looked like."""

    ttft_p95_ms: float
    itl_p95_ms: float
    served_tok_s: float
    gpu_util: float
    queue_requests: float
    ready: int
    provisioned: int


@dataclass(slots=True)
class Cluster:
    """Replicas (each with the time it becomes ready), the tau in force and the token backlog."""

    model: ReplicaModel
    ready_at_s: list[float] = field(default_factory=list)
    tau: int = 1
    backlog_tok: float = 0.0

    @classmethod
    def warm(cls, model: ReplicaModel, replicas: int, tau: int) -> Cluster:
        """A cluster whose `replicas` are already serving."""
        return cls(model=model, ready_at_s=[-math.inf] * replicas, tau=tau)

    def ready(self, now_s: float) -> int:
        return sum(1 for t in self.ready_at_s if t <= now_s)

    def set_replicas(self, replicas: int, now_s: float) -> None:
        """Add cold replicas, or remove the least ready ones first."""
        if replicas > len(self.ready_at_s):
            self.ready_at_s.extend([now_s + self.model.cold_start_s] * (replicas - len(self.ready_at_s)))
        elif replicas < len(self.ready_at_s):
            self.ready_at_s = sorted(self.ready_at_s)[:replicas]

    def step(self, requests_s: float, now_s: float, dt_s: float) -> StepOutcome:
        m = self.model
        ready = self.ready(now_s)
        demand = requests_s * m.mean_output_tokens
        capacity = ready * m.replica_tok_s * m.speedup(self.tau)
        served = min(demand + self.backlog_tok / dt_s, capacity)
        self.backlog_tok = max(0.0, self.backlog_tok + (demand - capacity) * dt_s)
        if capacity <= 0:
            held = math.inf if (demand > 0 or self.backlog_tok > 0) else 0.0
            return StepOutcome(
                held, held, 0.0, 0.0, self.backlog_tok / m.mean_output_tokens, 0, len(self.ready_at_s)
            )
        rho = demand / capacity
        rho_c = min(rho, 0.98)
        wait_ms = 1000.0 * self.backlog_tok / capacity + P95_OVER_MEAN * m.queue_jitter_ms * rho_c**2 / (
            1 - rho_c
        )
        ttft = m.prefill_ms * (1.0 + 0.5 * min(rho, 1.0)) + wait_ms
        itl = 1.2 * m.itl_tau1_ms / m.speedup(self.tau) * (1.0 + m.batch_slowdown * min(rho, 1.0))
        return StepOutcome(
            ttft_p95_ms=ttft,
            itl_p95_ms=itl,
            served_tok_s=served,
            gpu_util=min(1.0, m.gpu_util_gain * served / capacity),
            queue_requests=self.backlog_tok / m.mean_output_tokens,
            ready=ready,
            provisioned=len(self.ready_at_s),
        )
