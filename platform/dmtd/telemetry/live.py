"""Live per-variant statistics for the built-in dashboard (pure; a sliding time window, injected clock)."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dmtd.telemetry.cost import usd_per_million_tokens
from dmtd_contract.stats import percentile


@dataclass
class _Variant:
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (time, k) per block
    ttft_ms: deque[tuple[float, float]] = field(default_factory=deque)
    itl_ms: deque[tuple[float, float]] = field(default_factory=deque)
    k_hist: Counter[int] = field(default_factory=Counter)
    tau_hist: Counter[int] = field(default_factory=Counter)
    total_tokens: int = 0
    total_requests: int = 0
    slo_ok: int = 0
    tau_now: int = 0
    drafted: int = 0  # exact profile, since start: drafts checked, accepted, verified cycles that drafted
    accepted: int = 0
    checks: int = 0
    drafted_by_pos: Counter[int] = field(default_factory=Counter)
    accepted_by_pos: Counter[int] = field(default_factory=Counter)


class LiveStats:
    """Blocks and requests seen by the gateway → tokens/s, TTFT/ITL percentiles, τ and k histograms, $/1M."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_samples: int = 20000) -> None:
        self.window_s, self.clock, self.max_samples = window_s, clock, max_samples
        self.variants: dict[str, _Variant] = {}
        self.started = clock()
        self.series: deque[dict[str, Any]] = deque(maxlen=120)  # one point per snapshot, for sparklines

    def _v(self, variant: str) -> _Variant:
        v = self.variants.get(variant)
        if v is None:  # (setdefault built a _Variant, five deques and four Counters, on every block)
            v = self.variants[variant] = _Variant()
        return v

    def block(self, variant: str, k: int, tau: int, num_drafted: int = 0, num_accepted: int = 0) -> None:
        """A replica block: ``k`` tokens at ``tau``; of a verified cycle, its ``num_drafted`` drafts checked and
        the first ``num_accepted`` of them accepted."""
        v, now = self._v(variant), self.clock()
        if k > 0:
            v.tokens.append((now, k))
            v.total_tokens += k
            v.k_hist[k] += 1
        v.tau_hist[tau] += 1
        v.tau_now = tau
        if num_drafted > 0:
            v.drafted += num_drafted
            v.accepted += num_accepted
            v.checks += 1
            v.drafted_by_pos.update(range(1, num_drafted + 1))
            v.accepted_by_pos.update(range(1, num_accepted + 1))
        self._trim(v.tokens)

    def first_token(self, variant: str, ttft_ms: float) -> None:
        v = self._v(variant)
        v.ttft_ms.append((self.clock(), ttft_ms))
        self._trim(v.ttft_ms)

    def itl(self, variant: str, itl_ms: float, k: int) -> None:
        v, now = self._v(variant), self.clock()
        v.itl_ms.extend([(now, itl_ms)] * k)
        self._trim(v.itl_ms)

    def finished(self, variant: str, slo_ok: bool) -> None:
        v = self._v(variant)
        v.total_requests += 1
        v.slo_ok += slo_ok

    def _trim(self, d: deque[Any]) -> None:
        edge = self.clock() - self.window_s
        while d and (d[0][0] < edge or len(d) > self.max_samples):
            d.popleft()

    @staticmethod
    def _exact(v: _Variant) -> dict[str, Any] | None:
        """The exact profile's drafts since start (None before any): acceptance overall and by tail position,
        mean accepted per verified cycle."""
        if not v.drafted:
            return None
        return {"drafted": v.drafted, "accepted": v.accepted, "acceptance": v.accepted / v.drafted,
                "accepted_per_cycle": v.accepted / v.checks,
                "by_position": [{"position": p, "drafted": n, "accepted": v.accepted_by_pos[p],
                                 "acceptance": v.accepted_by_pos[p] / n} for p, n in sorted(v.drafted_by_pos.items())]}

    def snapshot(self, usd_per_hour: dict[str, float]) -> dict[str, Any]:
        """Per variant: tok/s over the window, percentiles, histograms, $/1M tokens at the current rate."""
        now = self.clock()
        span = max(1e-9, min(self.window_s, now - self.started))
        out: dict[str, Any] = {}
        for name, v in sorted(self.variants.items()):
            for d in (v.tokens, v.ttft_ms, v.itl_ms):
                self._trim(d)
            tok_s = sum(k for _, k in v.tokens) / span
            ttft = [x for _, x in v.ttft_ms]
            itl = [x for _, x in v.itl_ms]
            price = usd_per_hour.get(name, 0.0)
            out[name] = {
                "tokens_per_s": tok_s, "total_tokens": v.total_tokens, "requests": v.total_requests,
                "slo_attainment": v.slo_ok / v.total_requests if v.total_requests else None,
                "ttft_ms": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95), "p99": percentile(ttft, 0.99)},
                "itl_ms": {"p50": percentile(itl, 0.5), "p95": percentile(itl, 0.95), "p99": percentile(itl, 0.99)},
                "k_hist": {str(k): c for k, c in sorted(v.k_hist.items())},
                "tau_hist": {str(t): c for t, c in sorted(v.tau_hist.items())},
                "tau": v.tau_now, "usd_per_hour": price,
                "usd_per_million_tokens": usd_per_million_tokens(price, tok_s) if tok_s > 0 else None,
                "exact": self._exact(v),
            }
        self.series.append({"t": now - self.started, **{n: o["tokens_per_s"] for n, o in out.items()}})
        return {"window_s": self.window_s, "uptime_s": now - self.started, "variants": out,
                "series": list(self.series)}
