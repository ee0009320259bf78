"""The telemetry hooks without Ray: a replica (tiny engine) joins the caller's trace, its metrics add up,
the gateway's request telemetry measures TTFT and per-token ITL, settings come from args and OTEL_* env."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request

import pytest
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from dmtd.engine.config import DMTDConfig
from dmtd.serve.controller import ControllerConfig
from dmtd.serve.replica import DMTDReplica
from dmtd.telemetry.config import TelemetrySettings, telemetry_settings
from dmtd.telemetry.gateway import GatewayTelemetry
from dmtd.telemetry.logs import JsonFormatter
from dmtd.telemetry.prometheus import MetricsEndpoint
from dmtd_contract.records import Block, ReplicaRequest
from tests.conftest import tiny_engine, tiny_model


def samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_replica_span_is_the_callers_child_and_metrics_add_up():
    model = tiny_model(seed=3)
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=3, max_batch=4, hold_steps=10**9)
    rep = DMTDReplica(lambda: (tiny_engine(model, DMTDConfig(0, 4, 2, tau_max=4), max_num_seqs=4), cfg),
                      name="r0", variant="tiny")
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    async def run() -> list[Block]:
        return [b async for b in rep.generate(ReplicaRequest("q1", prompt_token_ids=[1, 2, 3], max_new_tokens=10,
                                                             traceparent=parent))]

    blocks = asyncio.run(run())
    (span,) = asyncio.run(rep.finished_spans("0af7651916cd43dd8448eb211c80319c"))
    assert span["parent_span_id"] == "b7ad6b7169203331" and span["attributes"]["dmtd.variant"] == "tiny"
    events = [e for e in span["events"] if e["name"] == "block"]
    assert [(e["attributes"]["k"], e["attributes"]["tau"]) for e in events] == [(b.k, b.tau) for b in blocks]
    s = samples(rep.telemetry.endpoint.exposition())
    assert s["dmtd_generated_tokens_total"] == 10 == s["dmtd_block_length_sum"]
    assert s["dmtd_block_length_count"] == len(blocks)
    assert s["dmtd_head_steps_total"] + s["dmtd_tail_steps_total"] == 10
    assert s["dmtd_request_gpu_seconds_count"] == 1 and s["dmtd_cost_usd_per_hour"] == 0.10
    # busy-time cost: every step's share at $0.10/hour, equal to the request's GPU-seconds at that price
    assert s["dmtd_busy_cost_usd_total"] == pytest.approx(s["dmtd_request_gpu_seconds_sum"] / 3600 * 0.10)
    assert rep.telemetry.metrics_url is None  # plain construction serves no port


def test_gateway_request_telemetry_measures_ttft_and_per_token_itl():
    now = [0.0]
    g = GatewayTelemetry(TelemetrySettings(metrics_port=None, itl_slo_ms=60.0), clock=lambda: now[0])
    rt = g.start("v", "req-1")
    assert rt.traceparent.startswith("00-" + rt.trace_id)
    now[0] = 0.5
    rt.cycle(2, 3)
    rt.delivered(2)  # TTFT 0.5 s, no ITL
    now[0] = 0.65
    rt.cycle(3, 3)
    rt.delivered(3)  # 3 tokens 150 ms after: 3 x 50 ms
    rt.finish("OK")
    s = samples(g.endpoint.exposition())
    assert s["dmtd_ttft_seconds_count"] == 1 and s["dmtd_ttft_seconds_sum"] == pytest.approx(0.5)
    assert s["dmtd_itl_seconds_count"] == 3 and s["dmtd_itl_seconds_sum"] == pytest.approx(0.15)
    assert s["dmtd_end_to_end_seconds_sum"] == pytest.approx(0.65) and s["dmtd_requests_total"] == 1
    assert s["dmtd_slo_compliant_requests_total"] == 1 and s["dmtd_inflight_requests"] == 0
    stats = g.stats()["variants"]["v"]
    assert stats["k_hist"] == {"2": 1, "3": 1} and stats["tau_hist"] == {"3": 2} and stats["total_tokens"] == 5
    assert stats["itl_ms"]["p50"] == pytest.approx(50.0) and stats["ttft_ms"]["p95"] == pytest.approx(500.0)
    g.rejected("v", "RESOURCE_EXHAUSTED")
    assert samples(g.endpoint.exposition())["dmtd_requests_total"] == 2
    assert stats["exact"] is None  # no verified cycle yet


def test_dashboard_stats_of_verified_cycles():
    """Blocks of the exact profile: acceptance overall and by tail position, mean accepted per cycle that
    drafted (a cycle of m drafts with a accepted: positions 1..m drafted, 1..a accepted)."""
    g = GatewayTelemetry(TelemetrySettings(metrics_port=None))
    rt = g.start("v", "req-1")
    for k, drafted, accepted in [(1, 0, 0), (3, 3, 2), (1, 3, 0), (4, 3, 3), (2, 1, 1), (1, 0, 0)]:
        rt.cycle(k, 4, "r", drafted, accepted)
    exact = g.stats()["variants"]["v"]["exact"]
    assert (exact["drafted"], exact["accepted"]) == (10, 6) and exact["acceptance"] == pytest.approx(0.6)
    assert exact["accepted_per_cycle"] == pytest.approx(6 / 4)  # 4 cycles drafted; the two plain ones do not count
    by_pos = {p["position"]: (p["drafted"], p["accepted"]) for p in exact["by_position"]}
    assert by_pos == {1: (4, 3), 2: (3, 2), 3: (3, 1)}
    assert [p["acceptance"] for p in exact["by_position"]] == pytest.approx([0.75, 2 / 3, 1 / 3])


def test_metrics_endpoint_serves_and_skips_a_busy_port():
    a = MetricsEndpoint("a", 0)
    b = MetricsEndpoint("b", a.port)  # busy: takes the next one
    try:
        assert a.port and b.port and b.port != a.port
        a.meter.create_counter("dmtd_cycles_cut_total").add(2, {"replica": "x"})
        body = urllib.request.urlopen(a.url, timeout=5).read().decode()
        assert 'dmtd_cycles_cut_total{replica="x"} 2.0' in body
    finally:
        a.shutdown()
        b.shutdown()


def test_settings_from_args_and_env():
    s = telemetry_settings({"deployment": "prod", "metrics_port": 9000, "telemetry": {"trace_sample_ratio": 0.25}},
                           env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"})
    assert s.deployment == "prod" and s.metrics_port == 9000 and s.replica_port() == 9000
    assert s.trace_exporter == "otlp" and s.otlp_endpoint == "http://collector:4318/v1/traces"
    assert s.trace_sample_ratio == 0.25
    assert telemetry_settings({}, env={"DMTD_DEPLOYMENT": "d1"}).deployment == "d1"
    priced = TelemetrySettings(replica_type="h100", gpus_per_replica=2)
    assert priced.usd_per_replica_hour == pytest.approx(2 * 2.99)
    assert TelemetrySettings(usd_per_gpu_hour=1.5, gpus_per_replica=4).usd_per_replica_hour == 6.0
    with pytest.raises(ValueError, match="no price"):
        _ = TelemetrySettings(replica_type="tpu").usd_per_replica_hour


def test_sampling_ratio_zero_records_nothing_but_still_propagates():
    g = GatewayTelemetry(TelemetrySettings(metrics_port=None, trace_sample_ratio=0.0))
    rt = g.start("v", "r")
    rt.finish("OK")
    assert g.tracing.finished_spans() == []
    assert int(rt.traceparent.rsplit("-", 1)[1], 16) & 1 == 0  # propagated, marked not sampled


def test_json_log_lines_carry_the_current_trace():
    g = GatewayTelemetry(TelemetrySettings(metrics_port=None))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("dmtd.test.json")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    with g.tracing.tracer.start_as_current_span("op") as span:
        logger.info("hello %s", "world", extra={"request_id": "abc"})
    rec = json.loads(stream.getvalue())
    assert rec["msg"] == "hello world" and rec["request_id"] == "abc" and rec["level"] == "info"
    assert rec["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert trace.get_current_span().get_span_context().is_valid is False


def test_histograms_count_cumulatively_and_a_value_on_a_bound_counts_in_its_bucket():
    """The instruments' own histograms (kept in process, read at scrape time) expose what Prometheus expects:
    cumulative buckets, a value equal to a bound in that bound's bucket, ``count`` observations at once."""
    from dmtd.telemetry.instruments import Instruments
    from dmtd.telemetry.prometheus import BLOCK_BUCKETS
    from dmtd_contract import metric_names as m

    ep = MetricsEndpoint("test", None)
    ins = Instruments(ep, "replica", {"replica": "r0", "variant": "v"})
    ins.record(m.BLOCK_LENGTH, 2.0, tau="3")
    ins.record_n(m.BLOCK_LENGTH, 3.0, 4, {"tau": "3"})
    ins.record(m.BLOCK_LENGTH, 99.0, tau="3")
    ins.add(m.GENERATED_TOKENS_TOTAL, 5)
    fams = {f.name: f for f in text_string_to_metric_families(ep.exposition())}
    buckets = {s.labels["le"]: s.value for s in fams["dmtd_block_length"].samples if s.name.endswith("_bucket")}
    assert [buckets[str(b)] for b in BLOCK_BUCKETS] == [0, 1, 5, 5, 5, 5, 5, 5] and buckets["+Inf"] == 6
    s = samples(ep.exposition())
    assert s["dmtd_block_length_count"] == 6 and s["dmtd_block_length_sum"] == 2 + 12 + 99
    assert s["dmtd_generated_tokens_total"] == 5
    ep.shutdown()
