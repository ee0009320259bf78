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


class LiveStats:
    """Blocks and requests seen by the gateway → tokens/s, TTFT/ITL percentiles, τ and k histograms, $/1M."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_samples: int = 20000) -> None:
        self.window_s, self.clock, self.max_samples = window_s, clock, max_samples
        self.variants: dict[str, _Variant] = {}
        self.started = clock()
        self.series: deque[dict[str, Any]] = deque(maxlen=120)  # one point per snapshot, for sparklines

    def _v(self, variant: str) -> _Variant:
        return self.variants.setdefault(variant, _Variant())

    def block(self, variant: str, k: int, tau: int) -> None:
        v, now = self._v(variant), self.clock()
        if k > 0:
            v.tokens.append((now, k))
            v.total_tokens += k
            v.k_hist[k] += 1
        v.tau_hist[tau] += 1
        v.tau_now = tau
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
            }
        self.series.append({"t": now - self.started, **{n: o["tokens_per_s"] for n, o in out.items()}})
        return {"window_s": self.window_s, "uptime_s": now - self.started, "variants": out,
                "series": list(self.series)}
