"""Operator-wide settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "DMTD_"


class OperatorConfig(BaseModel):
    """Defaults for every DMTDDeployment; a spec field, when set, wins over them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metrics_source: Literal["prometheus", "annotation", "none"] = Field(
        default="prometheus",
        description="Where metric windows come from (`annotation` is for tests and manual overrides).",
    )
    prometheus_url: str = Field(default="", description="Prometheus HTTP API base URL.")
    registry_url: str = Field(
        default="redis://dmtd-redis:6379/0",
        description="Variant registry (Redis) URL handed to the serving pods.",
    )
    registry_writer: Literal["redis", "configmap", "none"] = Field(
        default="configmap", description="How registry entries are published by the operator: the Redis "
        "registry at registry_url (plus a ConfigMap mirror), a ConfigMap only, or not at all."
    )
    reconcile_interval_s: float = Field(default=10.0, gt=0, le=600, description="Autoscaler timer period.")
    api_timeout_s: float = Field(default=30.0, gt=0, description="Timeout of one Kubernetes API call.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read `DMTD_<FIELD>` variables (e.g. DMTD_PROMETHEUS_URL)."""
        env = os.environ if environ is None else environ
        values = {
            name: env[ENV_PREFIX + name.upper()]
            for name in cls.model_fields
            if ENV_PREFIX + name.upper() in env
        }
        return cls.model_validate(values)
