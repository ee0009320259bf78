"""Deployment settings ``build_app`` reads from its args (or, for ``dmtd serve``, the environment): the
gateway's and the replicas' process environment, the replicas' stream interval and draft policy. Each bad
value raises ``ValueError`` naming its field, at build time."""

from __future__ import annotations

import os
from typing import Any


def _niceness(name: str, value: Any) -> str:
    text = str(value).strip()
    if not text.lstrip("-").isdigit() or not -20 <= int(text) <= 19:
        raise ValueError(f"{name}: must be a nice value in -20..19 (or 'ray' for Ray's own), got {value!r}")
    return str(int(text))


def serve_process_env(args: dict[str, Any]) -> dict[str, str]:
    """Environment of the gateway's and the replicas' Ray worker processes (see ``build_app``)."""
    env: dict[str, str] = {}
    niceness = args.get("worker_niceness", os.environ.get("DMTD_WORKER_NICENESS", 0))
    if niceness is not None and niceness not in ("", "ray"):
        env["RAY_worker_niceness"] = _niceness("worker_niceness", niceness)
    if not args.get("serve_user_thread", os.environ.get("DMTD_SERVE_USER_THREAD", "") not in ("", "0")):
        env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = "0"
    return env


def gateway_process_env(args: dict[str, Any]) -> dict[str, str]:
    """The gateway's: Serve's router on the gateway's own event loop (one thread hop less per streamed
    block; ``router_thread: true`` keeps Serve's default, a router loop in a thread of its own)."""
    env = serve_process_env(args)
    nice = args.get("gateway_niceness", os.environ.get("DMTD_GATEWAY_NICENESS"))
    if nice not in (None, ""):
        env["RAY_worker_niceness"] = _niceness("gateway_niceness", nice)
    if not args.get("router_thread", os.environ.get("DMTD_SERVE_ROUTER_THREAD", "") not in ("", "0")):
        env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "0"
    return env


def replica_process_env(args: dict[str, Any]) -> dict[str, str]:
    """A replica's: the OpenMP wait policy and spin count of its engine's thread pool."""
    env = serve_process_env(args)
    policy = str(args.get("omp_wait_policy", os.environ.get("DMTD_OMP_WAIT_POLICY", "")))
    if policy.upper() not in ("", "PASSIVE", "ACTIVE"):
        raise ValueError(f"omp_wait_policy: must be PASSIVE, ACTIVE or empty, got {policy!r}")
    if policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    spin = args.get("omp_spin_count", os.environ.get("DMTD_OMP_SPIN_COUNT"))  # unset: a short spin measured slower
    if spin is not None and str(spin) not in ("", "openmp") and not policy:
        if not str(spin).isdigit():
            raise ValueError(f"omp_spin_count: must be a whole number of spins, 'openmp' or empty, got {spin!r}")
        env["GOMP_SPINCOUNT"] = str(int(spin))
    return env


# a replica's engine: sequences at once, a sequence's positions at most, and its KV pool's positions (the bytes
# that 16 fixed slots of 2,048 positions held before pages); ``dmtd serve``, ``build_app`` and ``EngineFactory``
# take these
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_KV_CACHE_TOKENS = 32768

DEFAULT_STREAM_INTERVAL_MS = 40.0


def stream_interval(args: dict[str, Any]) -> float:
    """How long a replica gathers a request's ready blocks into one streamed item (0: every block at once)."""
    raw = args.get("stream_interval_ms", os.environ.get("DMTD_STREAM_INTERVAL_MS"))
    if raw in (None, ""):
        return DEFAULT_STREAM_INTERVAL_MS
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not 0.0 <= value <= 1000.0:
        raise ValueError(f"stream_interval_ms: must be a number of milliseconds within 0..1000, got {raw!r}")
    return value


def block_push(args: dict[str, Any]) -> str:
    """Where the gateway's block sink listens, which replicas push blocks to (dmtd.serve.push): ``auto``
    (default: loopback when the gRPC server listens on loopback, else the gateway's node address as Ray knows
    it), a host address, or ``off`` (replicas stream blocks back as items of the Serve call)."""
    raw = args.get("block_push", os.environ.get("DMTD_BLOCK_PUSH"))
    text = "auto" if raw in (None, "") else str(raw).strip()
    if text.lower() in ("auto", "off"):
        return text.lower()
    import ipaddress

    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise ValueError(f"block_push: must be 'auto', 'off' or an IP address to listen on, got {raw!r}") from None
    return text


def context_drafts_setting(value: Any) -> bool:
    """Whether exact greedy requests may check the context's own continuation instead of the tails' drafts (default
    on; EngineConfig.context_drafts): a bool, or ``true`` / ``false`` as text."""
    if value in (None, ""):
        return True
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"context_drafts: must be true or false, got {value!r}")
    return text == "true"


def drafts_setting(value: Any) -> str:
    """How exact requests draft: ``adaptive`` (default: the count that pays, none where none does) or ``fixed``."""
    text = "adaptive" if value in (None, "") else str(value)
    if text not in ("adaptive", "fixed"):
        raise ValueError(f"drafts: must be 'adaptive' or 'fixed', got {value!r}")
    return text
