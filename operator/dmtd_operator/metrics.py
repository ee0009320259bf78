"""Metrics windows and the pluggable sources the operator reads them from.

A `MetricsWindow` is what the policy sees: latency percentiles, load, utilisation and DMTD block length
over the last `window_s` seconds. A `MetricsSource` produces one per DMTDDeployment; the operator picks
one at startup (Prometheus by default, see `dmtd_operator.prometheus`) and keeps it in `kopf.Memo`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from dmtd_operator.resources import ANNOTATION_METRICS_WINDOW


@dataclass(frozen=True, slots=True)
class MetricsWindow:
    """Aggregates over one window. `None` means "no data" (e.g. no request finished in the window)."""

    window_s: float = 60.0
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None
    queue_depth: float = 0.0
    gpu_util: float | None = None
    tok_s: float = 0.0
    requests_s: float = 0.0
    mean_block_len: float | None = None
    ready_replicas: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"metrics window field {f.name} must be finite and >= 0, got {value!r}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MetricsWindow:
        """Build from snake_case or camelCase keys; unknown keys are an error."""
        known = {f.name: f.name for f in fields(cls)}
        known.update({_camel(name): name for name in list(known)})
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"unknown metrics window field {key!r}")
            name = known[key]
            kwargs[name] = (
                None if value is None else (int(value) if name == "ready_replicas" else float(value))
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p.capitalize() for p in rest)


@dataclass(frozen=True, slots=True)
class MetricsTarget:
    """Which deployment a window is wanted for, and what the source may need to find it."""

    namespace: str
    name: str
    window_s: float
    prometheus_url: str = ""
    annotations: Mapping[str, str] | None = None


class MetricsSource(Protocol):
    """Where metric windows come from."""

    async def fetch(self, target: MetricsTarget) -> MetricsWindow | None:
        """The latest window for `target`, or None when the source has no data for it yet."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class MetricsUnavailableError(RuntimeError):
    """The source exists but cannot answer now (network, 5xx); the operator retries later."""


class NullMetricsSource:
    """No metrics: the operator holds the replica count (never scales on missing data)."""

    async def fetch(self, target: MetricsTarget) -> MetricsWindow | None:
        return None

    async def close(self) -> None:
        return None


class StaticMetricsSource:
    """Fixed windows per `namespace/name` (or for everything under the key `*`), set in-process."""

    def __init__(self, windows: Mapping[str, MetricsWindow] | None = None) -> None:
        self.windows: dict[str, MetricsWindow] = dict(windows or {})

    async def fetch(self, target: MetricsTarget) -> MetricsWindow | None:
        return self.windows.get(f"{target.namespace}/{target.name}", self.windows.get("*"))

    async def close(self) -> None:
        return None


class AnnotationMetricsSource:
    """Reads a JSON window from the object's `metrics.serving.dmtd.dev/window` annotation.

    For tests and manual overrides (`kubectl annotate dmtd/x metrics.serving.dmtd.dev/window='{...}'`).
    """

    async def fetch(self, target: MetricsTarget) -> MetricsWindow | None:
        raw = (target.annotations or {}).get(ANNOTATION_METRICS_WINDOW)
        if not raw:
            return None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"annotation {ANNOTATION_METRICS_WINDOW} is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"annotation {ANNOTATION_METRICS_WINDOW} must be a JSON object")
        return MetricsWindow.from_dict(data)

    async def close(self) -> None:
        return None
