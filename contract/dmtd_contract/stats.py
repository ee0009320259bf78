"""Shared helpers of the serving side, the benchmarks and the operator: one percentile definition."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank: the smallest value with at least ``q`` of the values at
    or below it, ``sorted(values)[ceil(q * n) - 1]`` (the first value for q = 0); 0.0 for no values.
    p95 of 100 samples is the 95th smallest."""
    s = sorted(values)
    if not s:
        return 0.0
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
