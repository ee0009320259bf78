"""The autoscaling policy: pure functions from (metrics window, spec, state, now) to a decision.

No I/O and no clock: the caller passes `now_s`. The same function drives the operator and the
simulator (`dmtd bench autoscale`).

The rules, in order:

1. Demand (tokens/s) = max(served, arrivals x mean output) + the queue drained over one cold start.
2. Replicas are sized for the demand at the *baseline* tau and the target utilisation, with a dead band.
3. Latency SLOs lead: a TTFT or ITL p95 breach asks for one more replica even when the capacity model
   says there are enough (unless a scale-up is already cold-starting). GPU utilisation is only a
   guardrail, never a reason to add replicas (batching keeps it near 100% at any load): below its floor
   the GPUs have idle gaps, so a breach is not a capacity problem (hold) and, well inside the SLOs, a
   replica is surplus (remove one); at or above its ceiling scale-down goes one replica at a time.
4. Stabilisation: a scale-up uses the smallest recommendation of the scale-up window, a scale-down the
   largest of the scale-down window; steps are capped; scale-down waits for a cooldown after any change.
5. tau: a replica's capacity grows with tau, instantly. When the *ready* replicas cannot carry the demand
   at the baseline tau (a burst while new replicas cold-start) the upper tau bound widens at once; it
   narrows back only when no scale-up is pending and the demand fits the narrower tau with margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dmtd_operator.metrics import MetricsWindow
from dmtd_operator.spec import DMTDDeploymentSpec

SCALE_DOWN_LATENCY_HEADROOM = 0.8
"""Scale-down only while both latency p95s are below this fraction of their SLO."""
SURPLUS_LATENCY_HEADROOM = 0.5
"""The low-utilisation guardrail removes replicas only while latencies are below this fraction."""


@dataclass(frozen=True, slots=True)
class ScalerState:
    """What the policy remembers between evaluations (persisted in the object's status)."""

    replicas: int
    ready_replicas: int
    tau_max: int
    recommendations: tuple[tuple[float, int], ...] = ()
    last_scale_up_s: float = 0.0
    last_scale_down_s: float = 0.0
    last_demand_tok_s: float | None = None
    last_eval_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Replica count and tau bounds to apply, with the reason in words."""

    replicas: int
    tau_min: int
    tau_max: int
    reason: str
    demand_tok_s: float = 0.0
    breach: bool = False
    notes: tuple[str, ...] = field(default=())


def initial_state(spec: DMTDDeploymentSpec) -> ScalerState:
    """State of a freshly created deployment: the replica floor (at least one), baseline tau."""
    floor = max(spec.replicas.min, 1 if spec.replicas.max >= 1 else 0)
    return ScalerState(replicas=floor, ready_replicas=0, tau_max=spec.tau.baseline)


def effective_speedup(spec: DMTDDeploymentSpec, tau: int, block_ratio: float = 1.0) -> float:
    """Relative throughput at `tau` when cycles reach only `block_ratio` of their length on average.

    ConfAdapt may end a cycle early (k < tau); the speedup table is indexed by the achieved block
    length, interpolated linearly.
    """
    k = 1.0 + (tau - 1) * min(max(block_ratio, 0.0), 1.0)
    table = spec.capacity.tau_speedup
    lo = min(int(math.floor(k)), len(table))
    hi = min(lo + 1, len(table))
    frac = k - lo
    return table[lo - 1] + (table[hi - 1] - table[lo - 1]) * frac


def _block_ratio(window: MetricsWindow, tau_in_force: int) -> float:
    if window.mean_block_len is None or tau_in_force <= 1:
        return 1.0
    return min(max((window.mean_block_len - 1.0) / (tau_in_force - 1), 0.0), 1.0)


def demand_tok_s(window: MetricsWindow, spec: DMTDDeploymentSpec) -> float:
    """Token demand: what is served or arriving, plus the queue drained over one cold start.

    New replicas help only after their cold start, so sizing them to drain the backlog faster overshoots.
    """
    arriving = window.requests_s * spec.capacity.mean_output_tokens
    horizon_s = max(window.window_s, spec.scaling.cold_start_s)
    backlog = window.queue_depth * spec.capacity.mean_output_tokens / horizon_s
    return max(window.tok_s, arriving) + backlog


def slo_pressure(window: MetricsWindow, spec: DMTDDeploymentSpec) -> float:
    """Largest observed/SLO latency ratio (0 when no latency was observed)."""
    ratios = [0.0]
    if window.ttft_p95_ms is not None:
        ratios.append(window.ttft_p95_ms / spec.slo.ttft_p95_ms)
    if window.itl_p95_ms is not None:
        ratios.append(window.itl_p95_ms / spec.slo.itl_p95_ms)
    return max(ratios)


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def _recommend(
    window: MetricsWindow, spec: DMTDDeploymentSpec, state: ScalerState, demand: float, pressure: float
) -> tuple[int, list[str]]:
    """Raw replica recommendation before stabilisation, with notes on what shaped it."""
    notes: list[str] = []
    current, ready = state.replicas, state.ready_replicas
    per_replica = (
        spec.capacity.replica_tok_s * spec.speedup(spec.tau.baseline) * spec.scaling.target_utilization
    )
    raw = math.ceil(demand / per_replica - 1e-9) if demand > 0 else 0
    if current > 0 and raw > 0 and abs(demand / (current * per_replica) - 1.0) <= spec.scaling.tolerance:
        raw = current
    util = window.gpu_util
    idle_gpus = util is not None and ready > 0 and util < spec.gpu_utilization.min
    if pressure > 1.0 and raw <= current and ready >= current:
        if idle_gpus:
            notes.append(f"SLO breach with idle GPUs (util {util:.0%}): not a capacity problem, holding")
        else:
            raw = current + 1
            notes.append("SLO breach")
    if raw < current and pressure > SCALE_DOWN_LATENCY_HEADROOM:
        raw = current
        notes.append("latency near SLO blocks scale-down")
    elif raw >= current > 0 and idle_gpus and pressure < SURPLUS_LATENCY_HEADROOM:
        raw = current - 1
        notes.append(f"GPU utilisation {util:.0%} below floor: surplus replica")
    if current == 0 and (window.requests_s > 0 or window.queue_depth > 0):
        raw = max(raw, 1)
    return _clamp(raw, spec.replicas.min, spec.replicas.max), notes


def _stabilise(
    spec: DMTDDeploymentSpec, state: ScalerState, raw: int, now_s: float, gpu_util: float | None
) -> tuple[int, tuple[tuple[float, int], ...], str]:
    sc = spec.scaling
    busy = gpu_util is not None and gpu_util >= spec.gpu_utilization.max
    step_down = 1 if busy else sc.max_scale_down_replicas
    horizon = max(sc.scale_up_window_s, sc.scale_down_window_s)
    recs = tuple((t, r) for t, r in state.recommendations if now_s - t <= horizon) + ((now_s, raw),)
    current = state.replicas
    up = min(r for t, r in recs if now_s - t <= sc.scale_up_window_s)
    down = max(r for t, r in recs if now_s - t <= sc.scale_down_window_s)
    if current == 0 and raw > 0:
        return min(raw, sc.max_scale_up_replicas), recs, "scale from zero"
    if up > current:
        return min(up, current + sc.max_scale_up_replicas), recs, "scale up"
    if down < current:
        since_change = now_s - max(state.last_scale_up_s, state.last_scale_down_s)
        if since_change < sc.scale_down_cooldown_s:
            return current, recs, "scale-down cooling down"
        return max(down, current - step_down), recs, "scale down"
    if raw > current:
        return current, recs, "scale-up stabilising"
    if raw < current:
        return current, recs, "scale-down stabilising"
    return current, recs, "steady"


def _tau(
    window: MetricsWindow,
    spec: DMTDDeploymentSpec,
    state: ScalerState,
    demand: float,
    pressure: float,
    replicas: int,
    ready: int,
) -> tuple[int, str]:
    """Upper tau bound: widen at once when ready replicas fall short, narrow once capacity is ready."""
    lo, base, hi = spec.tau.min, spec.tau.baseline, spec.tau.max
    current = _clamp(state.tau_max, base, hi)
    if ready <= 0 or demand <= 0:
        return (current if replicas > ready else base), "no ready replicas" if ready <= 0 else "idle"
    ratio = _block_ratio(window, current)
    tol = spec.scaling.tolerance
    per_ready = ready * spec.capacity.replica_tok_s * spec.scaling.target_utilization

    def carries(tau: int, margin: float) -> bool:
        return per_ready * effective_speedup(spec, tau, ratio) * margin >= demand

    wanted = next((t for t in range(base, hi + 1) if carries(t, 1.0 + tol)), hi)
    if replicas > ready:
        # Bridge the cold start: ready replicas at `wanted` carry what the decided count would at baseline.
        gap = spec.speedup(base) * replicas / ready
        bridge = next((t for t in range(base, hi + 1) if effective_speedup(spec, t, ratio) >= gap), hi)
        wanted = max(wanted, bridge)
    keep = next((t for t in range(base, hi + 1) if carries(t, 1.0 + tol / 2)), hi)
    if pressure > 1.0:
        wanted = max(wanted, min(current + 1, hi))
    if wanted > current:
        return wanted, f"widen tau to {wanted} for instant capacity"
    pending = replicas > ready
    if keep < current and not pending and pressure <= SCALE_DOWN_LATENCY_HEADROOM:
        return max(keep, lo), f"narrow tau to {keep}: replicas ready"
    return current, "pending replicas keep tau wide" if pending and current > base else ""


def decide(
    window: MetricsWindow | None, spec: DMTDDeploymentSpec, state: ScalerState, now_s: float
) -> tuple[Decision, ScalerState]:
    """One evaluation: the decision to apply and the state to remember."""
    lo, hi = spec.replicas.min, spec.replicas.max
    if window is None:
        replicas = _clamp(state.replicas, lo, hi)
        tau_max = _clamp(state.tau_max, spec.tau.baseline, spec.tau.max)
        reason = "no metrics: holding replicas and tau"
        decision = Decision(replicas, spec.tau.min, tau_max, reason)
        return decision, replace(state, replicas=replicas, tau_max=tau_max, last_eval_s=now_s)
    ready = window.ready_replicas if window.ready_replicas is not None else state.ready_replicas
    state = replace(state, replicas=_clamp(state.replicas, lo, hi), ready_replicas=ready)
    demand = demand_tok_s(window, spec)
    pressure = slo_pressure(window, spec)
    raw, notes = _recommend(window, spec, state, demand, pressure)
    replicas, recs, action = _stabilise(spec, state, raw, now_s, window.gpu_util)
    replicas = _clamp(replicas, lo, hi)
    tau_max, tau_note = _tau(window, spec, state, demand, pressure, replicas, ready)
    last_up = now_s if replicas > state.replicas else state.last_scale_up_s
    last_down = now_s if replicas < state.replicas else state.last_scale_down_s
    reason = _reason(window, spec, state.replicas, replicas, ready, action, tau_note, notes, demand, pressure)
    decision = Decision(replicas, spec.tau.min, tau_max, reason, demand, pressure > 1.0, tuple(notes))
    new_state = ScalerState(
        replicas=replicas,
        ready_replicas=ready,
        tau_max=tau_max,
        recommendations=recs,
        last_scale_up_s=last_up,
        last_scale_down_s=last_down,
        last_demand_tok_s=demand,
        last_eval_s=now_s,
    )
    return decision, new_state


def _reason(
    window: MetricsWindow,
    spec: DMTDDeploymentSpec,
    before: int,
    after: int,
    ready: int,
    action: str,
    tau_note: str,
    notes: list[str],
    demand: float,
    pressure: float,
) -> str:
    parts: list[str] = []
    if window.ttft_p95_ms is not None and window.ttft_p95_ms > spec.slo.ttft_p95_ms:
        parts.append(f"ttft_p95 {window.ttft_p95_ms:.0f}ms > SLO {spec.slo.ttft_p95_ms:.0f}ms")
    if window.itl_p95_ms is not None and window.itl_p95_ms > spec.slo.itl_p95_ms:
        parts.append(f"itl_p95 {window.itl_p95_ms:.1f}ms > SLO {spec.slo.itl_p95_ms:.1f}ms")
    parts.append(f"demand {demand:.0f} tok/s")
    if after != before:
        parts.append(f"{action} {before}->{after} replicas ({ready} ready)")
    else:
        parts.append(f"{action} at {after} replicas ({ready} ready)")
    parts.extend(notes)
    if tau_note:
        parts.append(tau_note)
    return "; ".join(dict.fromkeys(parts))
