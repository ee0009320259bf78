"""The DMTDDeployment status: what the operator observed and decided, in the object itself.

The autoscaler's memory (recent recommendations, last change times) lives here too, so a restarted
operator continues where the previous one stopped instead of starting its windows from scratch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Observed(_Model):
    """The last metrics window the operator acted on."""

    ttft_p95_ms: float | None = Field(default=None, description="Observed TTFT p95, ms.")
    itl_p95_ms: float | None = Field(default=None, description="Observed per-token ITL p95, ms.")
    queue_depth: float | None = Field(default=None, description="Requests waiting at the gateway.")
    gpu_util: float | None = Field(default=None, description="Mean GPU utilisation, 0..1.")
    tok_s: float | None = Field(default=None, description="Generated tokens/s over all replicas.")
    requests_s: float | None = Field(default=None, description="Request arrivals per second.")
    mean_block_len: float | None = Field(default=None, description="Mean tokens emitted per DMTD cycle (k).")
    window_end: str = Field(default="", description="RFC 3339 end of the window.")


class TauInForce(_Model):
    """Tau bounds the replicas are told to use."""

    min: int = Field(default=1, description="Lower tau bound in force.")
    max: int = Field(default=1, description="Upper tau bound in force.")


class LastDecision(_Model):
    """The autoscaler's most recent decision and why."""

    replicas: int = Field(default=0, description="Replica count decided.")
    tau_min: int = Field(default=1, description="Lower tau bound decided.")
    tau_max: int = Field(default=1, description="Upper tau bound decided.")
    reason: str = Field(default="", description="Why, in words.")
    time: str = Field(default="", description="RFC 3339 time of the decision.")


class Recommendation(_Model):
    """One raw replica recommendation, kept for the stabilisation windows."""

    t_s: float = Field(description="Unix time of the recommendation, s.")
    replicas: int = Field(description="Recommended replica count.")


class AutoscalerMemory(_Model):
    """State the pure policy needs between evaluations."""

    recommendations: list[Recommendation] = Field(default_factory=list, description="Recent recommendations.")
    last_scale_up_s: float = Field(default=0.0, description="Unix time of the last scale-up, s.")
    last_scale_down_s: float = Field(default=0.0, description="Unix time of the last scale-down, s.")
    last_demand_tok_s: float | None = Field(
        default=None, description="Demand estimate at the last evaluation."
    )
    last_eval_s: float = Field(default=0.0, description="Unix time of the last evaluation, s.")


class Condition(_Model):
    """A Kubernetes-style condition."""

    type: str = Field(description="Condition type: Ready, Reconciled, SLOMet.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(default="", description="RFC 3339 time of the last status change.")


class DMTDDeploymentStatus(_Model):
    """Observed state of a DMTDDeployment."""

    observed_generation: int = Field(default=0, description="Generation of the spec last reconciled.")
    desired_replicas: int = Field(default=0, description="Replica count the operator wants.")
    ready_replicas: int = Field(default=0, description="Replicas serving now.")
    tau: TauInForce = Field(default_factory=TauInForce, description="Tau bounds in force.")
    observed: Observed = Field(default_factory=Observed, description="Last observed SLO figures.")
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
    last_decision: LastDecision = Field(default_factory=LastDecision, description="Last scaling decision.")
    autoscaler: AutoscalerMemory = Field(default_factory=AutoscalerMemory, description="Autoscaler memory.")
    ray_service: str = Field(default="", description="Name of the owned RayService.")
    gateway_service: str = Field(default="", description="Name of the owned gateway Service.")


def set_condition(conditions: list[Condition], new: Condition, now_rfc3339: str) -> list[Condition]:
    """Replace the condition of `new.type`, keeping its transition time when the status did not change."""
    out: list[Condition] = []
    for old in conditions:
        if old.type != new.type:
            out.append(old)
    previous = next((c for c in conditions if c.type == new.type), None)
    stamp = previous.last_transition_time if previous and previous.status == new.status else now_rfc3339
    out.append(new.model_copy(update={"last_transition_time": stamp}))
    return sorted(out, key=lambda c: c.type)
