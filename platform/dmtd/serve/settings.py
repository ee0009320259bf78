"""The serving side's reading of ``dmtd_contract.serve_config.ServeConfig``: a setting the arguments leave out
falls back to its ``DMTD_*`` environment variable (``dmtd serve`` and a RayService alike), top-level telemetry
names are checked, and the gateway's and replicas' process environments follow from the config. Each bad value
raises ``ServeConfigError`` (a ``ValueError``) naming its field, at build time."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dmtd.telemetry.config import TelemetrySettings
from dmtd_contract.serve_config import (
    DEFAULT_STREAM_INTERVAL_MS,
    EngineSettings,
    ServeConfig,
    ServeConfigError,
    VariantArgs,
)

__all__ = ["DEFAULT_STREAM_INTERVAL_MS", "ENV_FALLBACKS", "EngineSettings", "ServeConfig", "ServeConfigError",
           "VariantArgs", "engine_default", "gateway_process_env", "replica_process_env", "serve_config",
           "telemetry_args"]

# a setting the arguments do not name → this environment variable, when set and not blank
ENV_FALLBACKS = {
    "worker_niceness": "DMTD_WORKER_NICENESS",
    "gateway_niceness": "DMTD_GATEWAY_NICENESS",
    "serve_user_thread": "DMTD_SERVE_USER_THREAD",
    "router_thread": "DMTD_SERVE_ROUTER_THREAD",
    "omp_wait_policy": "DMTD_OMP_WAIT_POLICY",
    "omp_spin_count": "DMTD_OMP_SPIN_COUNT",  # unset: a short spin measured slower
    "stream_interval_ms": "DMTD_STREAM_INTERVAL_MS",
    "block_push": "DMTD_BLOCK_PUSH",
}
_SWITCHES = ("serve_user_thread", "router_thread")  # in the environment: anything but "" or "0" is on


def engine_default(name: str) -> Any:
    """The default of an engine setting (``dmtd serve``'s flags show these)."""
    return EngineSettings.model_fields[name].default


def serve_default(name: str) -> Any:
    """The default of a stack setting (``dmtd serve``'s flags show these)."""
    return ServeConfig.model_fields[name].default


def serve_config(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServeConfig:
    """``args`` (``build_app``'s, or ``dmtd serve``'s) validated, with the environment's fallbacks."""
    env = os.environ if environ is None else environ
    merged = dict(args)
    for name, var in ENV_FALLBACKS.items():
        raw = env.get(var, "")
        if name not in merged and raw.strip():
            merged[name] = (raw.strip() not in ("", "0")) if name in _SWITCHES else raw
    cfg = ServeConfig.parse(merged)
    unknown = sorted(set(cfg.model_extra or {}) - set(TelemetrySettings.model_fields))
    if unknown:
        raise ServeConfigError(f"{unknown[0]}: not a setting (a ServeConfig or TelemetrySettings field)")
    return cfg


def telemetry_args(cfg: ServeConfig) -> dict[str, Any]:
    """The ``TelemetrySettings`` fields the config sets (top level, then its ``telemetry`` dict); the metrics
    endpoints bind the gRPC server's host unless told otherwise (0.0.0.0 on Kubernetes)."""
    given = cfg.model_dump(exclude_unset=True)
    out = {k: given[k] for k in TelemetrySettings.model_fields if given.get(k) is not None}
    out.update(cfg.telemetry)
    out.setdefault("metrics_host", cfg.grpc_host)
    return out


def _serve_process_env(cfg: ServeConfig) -> dict[str, str]:
    """Environment of the gateway's and the replicas' Ray worker processes (see ``build_app``)."""
    env: dict[str, str] = {}
    if cfg.worker_niceness != "ray":
        env["RAY_worker_niceness"] = str(cfg.worker_niceness)
    if not cfg.serve_user_thread:
        env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = "0"
    return env


def gateway_process_env(cfg: ServeConfig) -> dict[str, str]:
    """The gateway's: Serve's router on the gateway's own event loop (one thread hop less per streamed
    block; ``router_thread: true`` keeps Serve's default, a router loop in a thread of its own)."""
    env = _serve_process_env(cfg)
    if cfg.gateway_niceness is not None:
        env["RAY_worker_niceness"] = str(cfg.gateway_niceness)
    if not cfg.router_thread:
        env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "0"
    return env


def replica_process_env(cfg: ServeConfig) -> dict[str, str]:
    """A replica's: the OpenMP wait policy and spin count of its engine's thread pool."""
    env = _serve_process_env(cfg)
    if cfg.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = cfg.omp_wait_policy
    elif cfg.omp_spin_count is not None:
        env["GOMP_SPINCOUNT"] = str(cfg.omp_spin_count)
    return env
