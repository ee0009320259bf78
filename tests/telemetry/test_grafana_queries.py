"""Every PromQL query of the Grafana dashboard shipped in the chart selects metrics the platform exports,
with the suffixes their kind has; every metric is documented in docs/metrics.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dmtd_contract import metric_names as m
from dmtd_operator import dashboard

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "helm" / "dmtd" / "files" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
PROMQL_WORDS = {"sum", "avg", "max", "min", "by", "rate", "histogram_quantile", "avg_over_time", "label_values",
                "count", "without", "on", "ignoring", "group_left", "irate", "increase"}


def selectors(expr: str) -> list[str]:
    """Metric names a PromQL expression selects (identifiers in front of a label matcher or a range)."""
    bare = re.sub(r'"[^"]*"', '""', expr)
    return re.findall(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", bare) + re.findall(
        r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[)", bare)


def exported() -> dict[str, m.MetricName]:
    return {metric.name + s: metric for metric in m.ALL for s in SUFFIXES[metric.kind]}


def test_chart_dashboard_is_the_generated_one():
    assert json.loads(BOARD.read_text()) == dashboard.dashboard()


def test_every_query_references_an_exported_metric():
    board = json.loads(BOARD.read_text())
    names = exported()
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(queries) >= 20
    used: set[str] = set()
    for q in queries:
        sel = [s for s in selectors(q) if s not in PROMQL_WORDS]
        assert sel, f"query selects no metric: {q}"
        for s in sel:
            assert s in names, f"{s!r} in {q!r} is not a metric the platform exports"
            used.add(names[s].name)
        # and no metric-looking identifier hides outside a selector
        assert set(re.findall(r"\bdmtd_[a-z0-9_]+", q)) <= set(names), q
    # the dashboard covers latency SLOs, throughput, τ/k, cost
    assert {m.TTFT_SECONDS.name, m.ITL_SECONDS.name, m.GENERATED_TOKENS_TOTAL.name, m.TAU.name,
            m.BLOCK_LENGTH.name, m.COST_USD_TOTAL.name, m.SLO_REQUESTS_TOTAL.name} <= used
    # … and the exact profile's drafts: acceptance, acceptance by tail position, accepted per cycle
    assert {m.DRAFTED_TOKENS_TOTAL.name, m.ACCEPTED_TOKENS_TOTAL.name, m.DRAFTED_BY_POSITION_TOTAL.name,
            m.ACCEPTED_BY_POSITION_TOTAL.name, m.ACCEPTED_PER_CYCLE.name} <= used


def test_selector_parser():
    q = 'sum by (le) (rate(dmtd_block_length_bucket{namespace=~"$ns",x="a{b"}[5m])) / dmtd_tau{a="b"}'
    assert selectors(q) == ["dmtd_block_length_bucket", "dmtd_tau"]


def test_every_metric_is_documented():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = [metric.name for metric in m.ALL if f"`{metric.name}`" not in doc]
    assert not missing, f"docs/metrics.md lacks {missing}"
