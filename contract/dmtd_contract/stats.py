"""Shared helpers of the serving side, the benchmarks and the operator: one percentile definition."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the upper nearest rank: ``sorted(values)[floor(q * n)]``, clamped to the
    last value; 0.0 for no values. p95 of 100 samples is the 96th smallest, so a p95 SLO check errs strict."""
    s = sorted(values)
    if not s:
        return 0.0
    return s[min(len(s) - 1, int(q * len(s)))]
