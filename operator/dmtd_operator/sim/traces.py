"""Load traces: request arrival rate per second, deterministic for a seed."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

TRACE_NAMES = ("steady", "diurnal", "burst", "ramp")


@dataclass(frozen=True, slots=True)
class Trace:
    """Arrival rate (requests/s) at each step of `dt_s` seconds."""

    name: str
    dt_s: float
    requests_s: tuple[float, ...]

    @property
    def duration_s(self) -> float:
        return self.dt_s * len(self.requests_s)


def _shape_steady(t: float, duration: float) -> float:
    return 1.0


def _shape_diurnal(t: float, duration: float) -> float:
    # One compressed day: night trough at 0.3x, afternoon peak at 1.5x.
    return 0.3 + 1.2 * 0.5 * (1.0 - math.cos(2.0 * math.pi * t / duration))


def burst_shape(
    start_frac: float = 0.25, hold_s: float = 600.0, ramp_s: float = 90.0, factor: float = 3.0
) -> Callable[[float, float], float]:
    """1x, then a ramp to `factor`x over `ramp_s`, held for `hold_s`, and back over `ramp_s`."""

    def shape(t: float, duration: float) -> float:
        t0 = start_frac * duration
        up_end, down_start = t0 + ramp_s, t0 + ramp_s + hold_s
        if t < t0 or t >= down_start + ramp_s:
            return 1.0
        if t < up_end:
            return 1.0 + (factor - 1.0) * (t - t0) / ramp_s
        if t < down_start:
            return factor
        return factor - (factor - 1.0) * (t - down_start) / ramp_s

    return shape


def _shape_ramp(t: float, duration: float) -> float:
    return 0.5 + 2.0 * t / duration


def make_trace(
    name: str,
    *,
    base_requests_s: float,
    duration_s: float,
    dt_s: float = 1.0,
    noise: float = 0.05,
    seed: int = 0,
    burst_factor: float = 3.0,
    burst_ramp_s: float = 90.0,
    burst_hold_s: float = 600.0,
) -> Trace:
    """Trace `name` (one of TRACE_NAMES) around `base_requests_s`, with multiplicative noise."""
    shapes: dict[str, Callable[[float, float], float]] = {
        "steady": _shape_steady,
        "diurnal": _shape_diurnal,
        "burst": burst_shape(factor=burst_factor, ramp_s=burst_ramp_s, hold_s=burst_hold_s),
        "ramp": _shape_ramp,
    }
    if name not in shapes:
        raise ValueError(f"unknown trace {name!r}; choose from {TRACE_NAMES}")
    rng = random.Random(f"{seed}:{name}")
    shape = shapes[name]
    steps = int(duration_s / dt_s)
    rates = tuple(
        max(0.0, base_requests_s * shape(i * dt_s, duration_s) * rng.gauss(1.0, noise)) for i in range(steps)
    )
    return Trace(name=name, dt_s=dt_s, requests_s=rates)
