"""The default metrics source: PromQL instant queries against a Prometheus HTTP API.

Every series is selected by `namespace` and `deployment` (the DMTDDeployment name), the labels the
ServiceMonitor and the serving side attach. Metric names come from `dmtd_contract.metric_names`.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp

from dmtd_contract import metric_names as m
from dmtd_operator.metrics import MetricsTarget, MetricsUnavailableError, MetricsWindow


def queries(target: MetricsTarget) -> dict[str, str]:
    """PromQL per MetricsWindow field, for `target`'s deployment over its window."""
    sel = f'namespace="{target.namespace}",deployment="{target.name}"'
    w = f"{max(int(target.window_s), 1)}s"

    def p95_ms(hist: m.MetricName) -> str:
        return f"histogram_quantile(0.95, sum by (le) (rate({hist.name}_bucket{{{sel}}}[{w}]))) * 1000"

    return {
        "ttft_p95_ms": p95_ms(m.TTFT_SECONDS),
        "itl_p95_ms": p95_ms(m.ITL_SECONDS),
        "queue_depth": f"sum({m.QUEUE_DEPTH.name}{{{sel}}})",
        "gpu_util": f"avg(avg_over_time({m.GPU_UTILIZATION.name}{{{sel}}}[{w}]))",
        "tok_s": f"sum(rate({m.GENERATED_TOKENS_TOTAL.name}{{{sel}}}[{w}]))",
        "requests_s": f"sum(rate({m.REQUESTS_TOTAL.name}{{{sel}}}[{w}]))",
        "mean_block_len": (
            f"sum(rate({m.BLOCK_LENGTH.name}_sum{{{sel}}}[{w}])) / "
            f"sum(rate({m.BLOCK_LENGTH.name}_count{{{sel}}}[{w}]))"
        ),
        "ready_replicas": f"max({m.REPLICAS_READY.name}{{{sel}}})",
    }


class PrometheusMetricsSource:
    """Reads windows from `base_url` (e.g. http://prometheus-operated.monitoring:9090).

    `base_url` may be overridden per deployment by `spec.metrics.prometheusUrl`.
    """

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def _scalar(self, base: str, promql: str) -> float | None:
        try:
            async with self._client().get(f"{base}/api/v1/query", params={"query": promql}) as resp:
                if resp.status >= 500:
                    raise MetricsUnavailableError(f"prometheus answered {resp.status}")
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise MetricsUnavailableError(f"prometheus at {base} unreachable: {e}") from e
        if body.get("status") != "success":
            raise ValueError(f"prometheus rejected {promql!r}: {body.get('error')}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return value if math.isfinite(value) else None

    async def fetch(self, target: MetricsTarget) -> MetricsWindow | None:
        base = (target.prometheus_url or self.base_url).rstrip("/")
        if not base:
            return None
        named = queries(target)
        values = await asyncio.gather(*(self._scalar(base, q) for q in named.values()))
        data = dict(zip(named, values))
        if all(v is None for v in data.values()):
            return None
        ready = data["ready_replicas"]
        return MetricsWindow(
            window_s=target.window_s,
            ttft_p95_ms=data["ttft_p95_ms"],
            itl_p95_ms=data["itl_p95_ms"],
            queue_depth=data["queue_depth"] or 0.0,
            gpu_util=data["gpu_util"],
            tok_s=data["tok_s"] or 0.0,
            requests_s=data["requests_s"] or 0.0,
            mean_block_len=data["mean_block_len"],
            ready_replicas=None if ready is None else round(ready),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
