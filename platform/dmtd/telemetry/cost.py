"""The cost model (pure arithmetic, no I/O): prices and measured throughput → $/1M tokens, instances, $/month.

Definitions (docs/cost.md):
  replica $/hour            = $/GPU-hour of its type x GPUs per replica
  GPU-seconds per request   = wall seconds of a run x GPUs / requests completed in it
  $/1M output tokens        = replica $/hour / (tokens/s per replica x 3600) x 1e6
  saving vs tau=1           = 1 - ($/1M at tau) / ($/1M at tau=1) = 1 - (tok/s at tau=1) / (tok/s at tau)
  $ per SLO-compliant req.  = replica $/hour x wall hours / (requests x SLO attainment)
  instances for a volume    = ceil(daily tokens / 86400 / (tok/s per replica x target utilisation))
  $/month                   = instances x replica $/hour x HOURS_PER_MONTH
"""

from __future__ import annotations

import math

HOURS_PER_MONTH = 730.0  # 365 x 24 / 12
SECONDS_PER_DAY = 86400.0


def replica_usd_per_hour(usd_per_gpu_hour: float, gpus_per_replica: int) -> float:
    if usd_per_gpu_hour < 0 or gpus_per_replica < 0:
        raise ValueError("prices and GPU counts must be >= 0")
    return usd_per_gpu_hour * max(1, gpus_per_replica)


def gpu_seconds_per_request(wall_s: float, requests: int, gpus_per_replica: int = 1) -> float:
    if requests <= 0:
        raise ValueError("requests must be > 0")
    return wall_s * max(1, gpus_per_replica) / requests


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        raise ValueError("tokens_per_s must be > 0")
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


def saving_vs_tau1(tokens_per_s: float, tau1_tokens_per_s: float) -> float:
    """Fraction of the τ=1 cost saved at the same price (negative when slower)."""
    if tokens_per_s <= 0 or tau1_tokens_per_s <= 0:
        raise ValueError("throughputs must be > 0")
    return 1.0 - tau1_tokens_per_s / tokens_per_s


def usd_per_slo_request(usd_per_hour: float, wall_s: float, requests: int, slo_attainment: float) -> float:
    """Cost of one request that met its SLO (inf when none did)."""
    compliant = requests * slo_attainment
    if compliant <= 0:
        return math.inf
    return usd_per_hour * wall_s / 3600.0 / compliant


def instances_needed(daily_tokens: float, tokens_per_s: float, target_utilization: float = 1.0,
                     peak_to_mean: float = 1.0) -> int:
    """Replicas to generate ``daily_tokens`` a day at ``peak_to_mean`` x the mean rate, each run at
    ``target_utilization`` of its measured throughput (at least one)."""
    if tokens_per_s <= 0 or not 0 < target_utilization <= 1 or peak_to_mean < 1:
        raise ValueError("need tokens_per_s > 0, 0 < target_utilization <= 1, peak_to_mean >= 1")
    rate = daily_tokens / SECONDS_PER_DAY * peak_to_mean
    return max(1, math.ceil(rate / (tokens_per_s * target_utilization) - 1e-9))


def usd_per_month(instances: int, usd_per_hour: float) -> float:
    return instances * usd_per_hour * HOURS_PER_MONTH
