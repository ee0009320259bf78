"""What the handlers do, as plain async functions of (runtime, object) -> status fields.

* `reconcile` (create / spec update / resume): render and apply the children at the scale in force.
* `autoscale` (timer): read a metrics window, run the policy, apply its decision, report it.
* `cleanup` (delete): remove the children and the registry entry.

Each returns the status to merge; the kopf handlers write it with `patch.status`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf
from pydantic import ValidationError

from dmtd_operator import render
from dmtd_operator import resources as r
from dmtd_operator.children import api_errors, apply_all, delete_all, owner_reference, ready_replicas
from dmtd_operator.metrics import MetricsTarget, MetricsUnavailableError, MetricsWindow
from dmtd_operator.policy import ScalerState, decide, initial_state, slo_pressure
from dmtd_operator.registry import RegistryEntry, VariantEntry
from dmtd_operator.runtime import Runtime
from dmtd_operator.spec import DMTDDeploymentSpec
from dmtd_operator.status import (
    AutoscalerMemory,
    Condition,
    DMTDDeploymentStatus,
    LastDecision,
    Observed,
    Recommendation,
    TauInForce,
    set_condition,
)


def parse_spec(raw: Mapping[str, Any]) -> DMTDDeploymentSpec:
    """The validated spec; an invalid one is a permanent error (fix the object, no retry helps)."""
    try:
        return DMTDDeploymentSpec.model_validate(dict(raw))
    except ValidationError as e:
        raise kopf.PermanentError(f"invalid spec: {e}") from e


def parse_status(raw: Mapping[str, Any] | None) -> DMTDDeploymentStatus:
    """The status as last written (unreadable parts fall back to defaults)."""
    try:
        return DMTDDeploymentStatus.model_validate(dict(raw or {}))
    except ValidationError:
        return DMTDDeploymentStatus()


def _rfc3339(t_s: float) -> str:
    return datetime.datetime.fromtimestamp(t_s, tz=datetime.UTC).isoformat(timespec="seconds")


def state_of(status: DMTDDeploymentStatus, spec: DMTDDeploymentSpec) -> ScalerState:
    """The policy state persisted in `status` (a fresh one for a new object)."""
    if status.desired_replicas == 0 and not status.last_decision.time:
        return initial_state(spec)
    mem = status.autoscaler
    return ScalerState(
        replicas=status.desired_replicas,
        ready_replicas=status.ready_replicas,
        tau_max=status.tau.max,
        recommendations=tuple((rec.t_s, rec.replicas) for rec in mem.recommendations),
        last_scale_up_s=mem.last_scale_up_s,
        last_scale_down_s=mem.last_scale_down_s,
        last_demand_tok_s=mem.last_demand_tok_s,
        last_eval_s=mem.last_eval_s,
    )


def _target(
    rt: Runtime,
    name: str,
    namespace: str,
    uid: str,
    spec: DMTDDeploymentSpec,
    state: ScalerState,
    tau_min: int,
) -> render.Target:
    lo, hi = spec.replicas.min, spec.replicas.max
    return render.Target(
        name=name,
        namespace=namespace,
        spec=spec,
        replicas=max(lo, min(hi, state.replicas)),
        tau_min=tau_min,
        tau_max=max(spec.tau.baseline, min(spec.tau.max, state.tau_max)),
        registry_url=spec.serving.registry_url or rt.config.registry_url,
        owner=owner_reference(name, uid) if uid else None,
    )


async def _publish(rt: Runtime, t: render.Target) -> None:
    entry = RegistryEntry(
        namespace=t.namespace,
        deployment=t.name,
        variants=tuple(VariantEntry(v.name, v.model_uri, v.weight) for v in t.spec.variants),
        replicas=t.replicas,
        tau_min=t.tau_min,
        tau_max=t.tau_max,
        gateway=f"{r.gateway_service_name(t.name)}.{t.namespace}.svc:{r.GATEWAY_GRPC_PORT}",
        registry_url=t.registry_url,
    )
    async with api_errors("registry entry"):
        await rt.registry.publish(entry, t.owner)


def _ready_condition(desired: int, ready: int) -> Condition:
    ok = ready >= desired
    return Condition(
        type="Ready",
        status="True" if ok else "False",
        reason="ReplicasReady" if ok else "ColdStarting",
        message=f"{ready}/{desired} replicas ready",
    )


async def _apply(
    rt: Runtime, target: render.Target, status: DMTDDeploymentStatus, publish: bool, ready: int | None
) -> tuple[DMTDDeploymentStatus, str]:
    """Apply the children and registry entry; the status fields every writer keeps current.

    Both the spec handler and the timer write these, so whichever runs last leaves a complete status.
    """
    async with api_errors(f"applying children of {target.namespace}/{target.name}"):
        live_rs, _ = await apply_all(rt.api, target)
    if publish:
        await _publish(rt, target)
    now = _rfc3339(rt.clock())
    if ready is None:
        ready = ready_replicas(live_rs, target.replicas)
    reconciled = Condition(
        type="Reconciled",
        status="True",
        reason="ChildrenApplied",
        message=f"RayService {r.ray_service_name(target.name)} and gateway Service applied",
    )
    conditions = set_condition(status.conditions, reconciled, now)
    conditions = set_condition(conditions, _ready_condition(target.replicas, ready), now)
    new = status.model_copy(
        update={
            "desired_replicas": target.replicas,
            "ready_replicas": ready,
            "tau": TauInForce(min=target.tau_min, max=target.tau_max),
            "conditions": conditions,
            "ray_service": r.ray_service_name(target.name),
            "gateway_service": r.gateway_service_name(target.name),
        }
    )
    return new, now


async def reconcile(
    rt: Runtime,
    name: str,
    namespace: str,
    uid: str,
    generation: int,
    raw_spec: Mapping[str, Any],
    raw_status: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Apply the children for the current spec at the replica count and tau in force."""
    spec = parse_spec(raw_spec)
    status = parse_status(raw_status)
    state = state_of(status, spec)
    target = _target(rt, name, namespace, uid, spec, state, spec.tau.min)
    new, _ = await _apply(rt, target, status, publish=True, ready=None)
    return new.model_copy(update={"observed_generation": generation}).model_dump(by_alias=True, mode="json")


async def _window(
    rt: Runtime, spec: DMTDDeploymentSpec, name: str, namespace: str, annotations: Mapping[str, str]
) -> tuple[MetricsWindow | None, str]:
    target = MetricsTarget(
        namespace=namespace,
        name=name,
        window_s=spec.metrics.window_s,
        prometheus_url=spec.metrics.prometheus_url,
        annotations=annotations,
    )
    try:
        window = await rt.metrics.fetch(target)
    except MetricsUnavailableError as e:
        return None, f"metrics unavailable: {e}"
    except ValueError as e:
        return None, f"metrics unreadable: {e}"
    return window, "" if window is not None else "no metrics for this deployment yet"


def _observed(window: MetricsWindow | None, now: str, previous: Observed) -> Observed:
    if window is None:
        return previous
    return Observed(
        ttft_p95_ms=window.ttft_p95_ms,
        itl_p95_ms=window.itl_p95_ms,
        queue_depth=window.queue_depth,
        gpu_util=window.gpu_util,
        tok_s=window.tok_s,
        requests_s=window.requests_s,
        mean_block_len=window.mean_block_len,
        window_end=now,
    )


def _memory(state: ScalerState) -> AutoscalerMemory:
    return AutoscalerMemory(
        recommendations=[Recommendation(t_s=t, replicas=n) for t, n in state.recommendations],
        last_scale_up_s=state.last_scale_up_s,
        last_scale_down_s=state.last_scale_down_s,
        last_demand_tok_s=state.last_demand_tok_s,
        last_eval_s=state.last_eval_s,
    )


async def autoscale(
    rt: Runtime,
    name: str,
    namespace: str,
    uid: str,
    raw_spec: Mapping[str, Any],
    raw_status: Mapping[str, Any] | None,
    annotations: Mapping[str, str],
) -> dict[str, Any] | None:
    """One policy evaluation; None when the deployment's own interval has not elapsed yet."""
    spec = parse_spec(raw_spec)
    status = parse_status(raw_status)
    now_s = rt.clock()
    state = state_of(status, spec)
    if status.last_decision.time and now_s - state.last_eval_s < spec.scaling.interval_s * 0.9:
        return None
    window, metrics_note = await _window(rt, spec, name, namespace, annotations)
    decision, new_state = decide(window, spec, state, now_s)
    target = _target(rt, name, namespace, uid, spec, new_state, decision.tau_min)
    changed = (decision.replicas, decision.tau_max) != (state.replicas, state.tau_max)
    metrics_ready = window.ready_replicas if window is not None else None
    new, now = await _apply(rt, target, status, publish=changed, ready=metrics_ready)
    new_state = replace(new_state, ready_replicas=new.ready_replicas)
    reason = f"{metrics_note}; {decision.reason}" if metrics_note else decision.reason
    last = LastDecision(
        replicas=decision.replicas,
        tau_min=decision.tau_min,
        tau_max=decision.tau_max,
        reason=reason,
        time=now,
    )
    new = new.model_copy(
        update={
            "observed": _observed(window, now, status.observed),
            "conditions": set_condition(new.conditions, _slo_condition(window, spec), now),
            "last_decision": last,
            "autoscaler": _memory(new_state),
        }
    )
    return new.model_dump(by_alias=True, mode="json")


def _slo_condition(window: MetricsWindow | None, spec: DMTDDeploymentSpec) -> Condition:
    if window is None:
        return Condition(type="SLOMet", status="Unknown", reason="NoMetrics", message="no metrics window")
    pressure = slo_pressure(window, spec)
    met = pressure <= 1.0
    return Condition(
        type="SLOMet",
        status="True" if met else "False",
        reason="WithinSLO" if met else "SLOBreach",
        message=f"worst latency at {pressure:.0%} of its SLO",
    )


async def cleanup(rt: Runtime, name: str, namespace: str) -> list[str]:
    """Delete the children and withdraw the registry entry; returns what was deleted."""
    async with api_errors(f"deleting children of {namespace}/{name}"):
        deleted = await delete_all(rt.api, namespace, name)
        await rt.registry.withdraw(namespace, name)
    return deleted
