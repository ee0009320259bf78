"""The Prometheus metrics source against a Prometheus HTTP API stand-in (kmock over real HTTP)."""

from __future__ import annotations

import asyncio
import json

import kmock
import pytest

from dmtd_contract import metric_names as m
from dmtd_operator.metrics import (
    AnnotationMetricsSource,
    MetricsTarget,
    MetricsUnavailableError,
    MetricsWindow,
)
from dmtd_operator.prometheus import PrometheusMetricsSource, queries

TARGET = MetricsTarget(namespace="prod", name="chat", window_s=60)

ANSWERS = {  # metric name in the query -> value Prometheus returns
    m.TTFT_SECONDS.name: "812.5",
    m.ITL_SECONDS.name: "31.25",
    m.QUEUE_DEPTH.name: "7",
    m.GPU_UTILIZATION.name: "0.93",
    m.GENERATED_TOKENS_TOTAL.name: "5120",
    m.REQUESTS_TOTAL.name: "20",
    m.BLOCK_LENGTH.name: "2.6",
    m.REPLICAS_READY.name: "3",
}


def answer(request: kmock.Request) -> dict[str, object]:
    promql = request.params["query"]
    value = next(v for name, v in ANSWERS.items() if name in promql)
    return {
        "status": "success",
        "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]},
    }


async def fetch_from_stand_in() -> tuple[MetricsWindow | None, list[str]]:
    async with kmock.RawHandler() as prom, kmock.Server(prom) as server:
        prom["get /api/v1/query"] << answer
        source = PrometheusMetricsSource(str(server.url))
        try:
            window = await source.fetch(TARGET)
        finally:
            await source.close()
        return window, [rq.params["query"] for rq in prom]


def test_queries_select_the_deployment_and_use_our_metric_names() -> None:
    q = queries(TARGET)
    assert set(q) == {
        "ttft_p95_ms",
        "itl_p95_ms",
        "queue_depth",
        "gpu_util",
        "tok_s",
        "requests_s",
        "mean_block_len",
        "ready_replicas",
    }
    assert all('namespace="prod",deployment="chat"' in promql for promql in q.values())
    assert (
        q["ttft_p95_ms"].startswith("histogram_quantile(0.95")
        and "dmtd_ttft_seconds_bucket" in q["ttft_p95_ms"]
    )
    assert "[60s]" in q["tok_s"]


def test_window_is_read_over_http() -> None:
    window, sent = asyncio.run(fetch_from_stand_in())
    assert window == MetricsWindow(
        window_s=60,
        ttft_p95_ms=812.5,
        itl_p95_ms=31.25,
        queue_depth=7,
        gpu_util=0.93,
        tok_s=5120,
        requests_s=20,
        mean_block_len=2.6,
        ready_replicas=3,
    )
    assert sorted(sent) == sorted(queries(TARGET).values())


def test_unreachable_prometheus_is_a_transient_error() -> None:
    async def fetch() -> None:
        source = PrometheusMetricsSource("http://127.0.0.1:9", timeout_s=1)
        try:
            await source.fetch(TARGET)
        finally:
            await source.close()

    with pytest.raises(MetricsUnavailableError):
        asyncio.run(fetch())


def test_annotation_source_reads_camel_case_json() -> None:
    raw = {"windowS": 30, "ttftP95Ms": 1200, "requestsS": 4, "readyReplicas": 2}
    target = MetricsTarget("ns", "x", 60, annotations={"metrics.serving.dmtd.dev/window": json.dumps(raw)})
    window = asyncio.run(AnnotationMetricsSource().fetch(target))
    assert window == MetricsWindow(window_s=30, ttft_p95_ms=1200, requests_s=4, ready_replicas=2)
    with pytest.raises(ValueError, match="unknown metrics window field 'ttft'"):
        MetricsWindow.from_dict({"ttft": 1})
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        MetricsWindow(tok_s=-1)
