"""The three policies the simulator compares, behind one small interface.

* `tau_aware`    - `dmtd_operator.policy.decide`, as the operator runs it.
* `replica_only` - the same policy with tau pinned to the baseline (scales replicas only).
* `ray_default`  - Ray Serve's request-based autoscaler: replicas = ceil(ongoing / target_ongoing_requests),
                   applied after `upscale_delay_s` / `downscale_delay_s` of agreement (Ray's defaults 30 s
                   and 600 s), tau pinned to the baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from dmtd_operator.metrics import MetricsWindow
from dmtd_operator.policy import ScalerState, decide
from dmtd_operator.spec import DMTDDeploymentSpec, TauPolicy

POLICY_NAMES = ("tau_aware", "replica_only", "ray_default")


class Controller(Protocol):
    """Turns a metrics window into (replicas, upper tau bound)."""

    name: str

    def evaluate(self, window: MetricsWindow, now_s: float) -> tuple[int, int]: ...


class PolicyController:
    """Our policy; with `pin_tau` the tau bounds collapse to the baseline (the replica-only baseline)."""

    def __init__(self, name: str, spec: DMTDDeploymentSpec, replicas: int, *, pin_tau: bool) -> None:
        if pin_tau:
            base = spec.tau.baseline
            spec = spec.model_copy(update={"tau": TauPolicy(min=base, baseline=base, max=base)})
        self.name = name
        self.spec = spec
        self.state = ScalerState(replicas=replicas, ready_replicas=replicas, tau_max=spec.tau.baseline)
        self.reasons: list[tuple[float, str]] = []

    def evaluate(self, window: MetricsWindow, now_s: float) -> tuple[int, int]:
        decision, self.state = decide(window, self.spec, self.state, now_s)
        self.reasons.append((now_s, decision.reason))
        return decision.replicas, decision.tau_max


@dataclass(slots=True)
class RayDefaultController:
    """Ray Serve's autoscaling algorithm, on total ongoing requests (in flight + queued)."""

    spec: DMTDDeploymentSpec
    replicas: int
    target_ongoing_requests: float
    mean_output_tokens: float
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    name: str = "ray_default"
    _up_since: float | None = None
    _down_since: float | None = None

    def evaluate(self, window: MetricsWindow, now_s: float) -> tuple[int, int]:
        ttft_s = (window.ttft_p95_ms or 0.0) / 1000.0 / 3.0
        itl_s = (window.itl_p95_ms or 0.0) / 1000.0
        in_flight = window.requests_s * (min(ttft_s, 60.0) + self.mean_output_tokens * itl_s)
        ongoing = in_flight + window.queue_depth
        desired = math.ceil(ongoing / self.target_ongoing_requests - 1e-9)
        desired = max(self.spec.replicas.min, min(self.spec.replicas.max, desired))
        if self.replicas == 0 and desired > 0:
            self.replicas = desired
        elif desired > self.replicas:
            self._down_since = None
            self._up_since = now_s if self._up_since is None else self._up_since
            if now_s - self._up_since >= self.upscale_delay_s:
                self.replicas, self._up_since = desired, None
        elif desired < self.replicas:
            self._up_since = None
            self._down_since = now_s if self._down_since is None else self._down_since
            if now_s - self._down_since >= self.downscale_delay_s:
                self.replicas, self._down_since = desired, None
        else:
            self._up_since = self._down_since = None
        return self.replicas, self.spec.tau.baseline


def calibrated_target_ongoing(spec: DMTDDeploymentSpec, itl_ms: float, prefill_ms: float) -> float:
    """Ongoing requests of one replica at the target utilisation: a fair `target_ongoing_requests`.

    Ray Serve's library default (2) suits one-request-at-a-time models; a batching LLM replica holds
    dozens of requests, so the comparison uses this calibrated value unless a flag overrides it.
    """
    cap = spec.capacity
    per_replica_rps = cap.replica_tok_s * spec.speedup(spec.tau.baseline) * spec.scaling.target_utilization
    per_replica_rps /= cap.mean_output_tokens
    latency_s = prefill_ms / 1000.0 + cap.mean_output_tokens * itl_ms / 1000.0
    return max(1.0, per_replica_rps * latency_s)


def make_controller(
    name: str, spec: DMTDDeploymentSpec, replicas: int, *, target_ongoing: float, mean_output_tokens: float
) -> Controller:
    """Controller `name` (one of POLICY_NAMES) starting at `replicas`."""
    if name == "tau_aware":
        return PolicyController(name, spec, replicas, pin_tau=False)
    if name == "replica_only":
        return PolicyController(name, spec, replicas, pin_tau=True)
    if name == "ray_default":
        return RayDefaultController(spec, replicas, target_ongoing, mean_output_tokens)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")
