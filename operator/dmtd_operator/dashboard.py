"""The Grafana dashboard of the platform, built from `metric_names` so the names cannot drift.

`python -m dmtd_operator.dashboard PATH` writes it; the chart ships the output in
`helm/dmtd/files/grafana-dashboard.json` and a test keeps the two identical.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dmtd_contract import metric_names as m

SEL = 'namespace=~"$namespace",deployment=~"$deployment"'


def _p95_ms(hist: m.MetricName, by: str = "deployment") -> str:
    return f"histogram_quantile(0.95, sum by ({by}, le) (rate({hist.name}_bucket{{{SEL}}}[5m]))) * 1000"


def _rate(counter: m.MetricName, by: str = "deployment") -> str:
    return f"sum by ({by}) (rate({counter.name}{{{SEL}}}[5m]))"


def _mean(hist: m.MetricName, by: str = "deployment") -> str:
    rate = "sum by (" + by + ") (rate({name}{{" + SEL + "}}[5m]))"
    return f"{rate.format(name=hist.name + '_sum')} / {rate.format(name=hist.name + '_count')}"


def _gauge(metric: m.MetricName, agg: str = "avg", by: str = "deployment") -> str:
    return f"{agg} by ({by}) ({metric.name}{{{SEL}}})"


VARIANT = "deployment, variant"
USD_PER_HOUR = _gauge(m.COST_USD_PER_HOUR, "sum")

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Latency SLOs",
        "ms",
        [
            ("TTFT p95 {{deployment}}/{{variant}}", _p95_ms(m.TTFT_SECONDS, VARIANT)),
            ("ITL p95 {{deployment}}/{{variant}}", _p95_ms(m.ITL_SECONDS, VARIANT)),
            ("e2e p95 {{deployment}}/{{variant}}", _p95_ms(m.E2E_SECONDS, VARIANT)),
        ],
    ),
    (
        "SLO attainment",
        "percentunit",
        [
            (
                "SLO-compliant share {{deployment}}/{{variant}}",
                f"{_rate(m.SLO_REQUESTS_TOTAL, VARIANT)} / "
                f'sum by ({VARIANT}) (rate({m.REQUESTS_TOTAL.name}{{{SEL},code="OK"}}[5m]))',
            ),
        ],
    ),
    (
        "Throughput",
        "short",
        [
            ("tokens/s {{deployment}}/{{variant}}", _rate(m.GENERATED_TOKENS_TOTAL, VARIANT)),
            ("requests/s {{deployment}}", _rate(m.REQUESTS_TOTAL)),
            ("queued {{deployment}}", _gauge(m.QUEUE_DEPTH, "sum")),
            ("in flight {{deployment}}", _gauge(m.INFLIGHT, "sum")),
        ],
    ),
    (
        "tau and block length k",
        "short",
        [
            ("tau in force {{deployment}}/{{variant}}", _gauge(m.TAU, "avg", VARIANT)),
            ("tau max {{deployment}}", _gauge(m.TAU_MAX)),
            ("tau min {{deployment}}", _gauge(m.TAU_MIN)),
            ("mean k {{deployment}}/{{variant}}", _mean(m.BLOCK_LENGTH, VARIANT)),
            ("gate {{deployment}}", _gauge(m.MIN_CONFIDENCE)),
        ],
    ),
    (
        "Block length k distribution",
        "short",
        [("k <= {{le}}", f"sum by (le) (rate({m.BLOCK_LENGTH.name}_bucket{{{SEL}}}[5m]))")],
    ),
    (
        "Confidence cuts and head/tail steps",
        "short",
        [
            ("cycles cut/s {{deployment}}", _rate(m.CYCLES_CUT_TOTAL)),
            ("head steps/s {{deployment}}", _rate(m.HEAD_STEPS_TOTAL)),
            ("tail steps/s {{deployment}}", _rate(m.TAIL_STEPS_TOTAL)),
            ("engine steps/s {{kind}}", _rate(m.ENGINE_STEPS_TOTAL, "deployment, kind")),
        ],
    ),
    (
        "Exact profile: draft acceptance",
        "percentunit",
        [
            ("acceptance {{deployment}}/{{variant}}",
             f"{_rate(m.ACCEPTED_TOKENS_TOTAL, VARIANT)} / {_rate(m.DRAFTED_TOKENS_TOTAL, VARIANT)}"),
            ("acceptance at tail {{position}}",
             f"{_rate(m.ACCEPTED_BY_POSITION_TOTAL, 'position')} / {_rate(m.DRAFTED_BY_POSITION_TOTAL, 'position')}"),
        ],
    ),
    (
        "Exact profile: drafts and accepted per cycle",
        "short",
        [
            ("drafted tokens/s {{deployment}}/{{variant}}", _rate(m.DRAFTED_TOKENS_TOTAL, VARIANT)),
            ("accepted tokens/s {{deployment}}/{{variant}}", _rate(m.ACCEPTED_TOKENS_TOTAL, VARIANT)),
            ("mean accepted per verified cycle {{deployment}}/{{variant}}", _mean(m.ACCEPTED_PER_CYCLE, VARIANT)),
        ],
    ),
    (
        "Replicas, batch and GPU utilisation",
        "short",
        [
            ("ready replicas {{deployment}}", _gauge(m.REPLICAS_READY, "sum")),
            ("mean batch {{deployment}}", _gauge(m.BATCH_SIZE)),
            ("KV occupancy {{deployment}}", _gauge(m.KV_CACHE_OCCUPANCY)),
            ("GPU util {{deployment}}", _gauge(m.GPU_UTILIZATION)),
            ("CPU util {{deployment}}", _gauge(m.CPU_UTILIZATION)),
            ("GPU memory GiB {{deployment}}", f"{_gauge(m.GPU_MEMORY_USED_BYTES, 'sum')} / 2^30"),
        ],
    ),
    (
        "Cost",
        "currencyUSD",
        [
            ("$/hour {{deployment}}", USD_PER_HOUR),
            (
                "$/1M tokens {{deployment}}/{{variant}}",
                f"{_rate(m.COST_USD_TOTAL, VARIANT)} / {_rate(m.GENERATED_TOKENS_TOTAL, VARIANT)} * 1e6",
            ),
            (
                "$ per SLO-compliant request {{deployment}}/{{variant}}",
                f"{_rate(m.COST_USD_TOTAL, VARIANT)} / {_rate(m.SLO_REQUESTS_TOTAL, VARIANT)}",
            ),
            (
                "GPU-seconds per request {{deployment}}/{{variant}}",
                _mean(m.REQUEST_GPU_SECONDS, VARIANT),
            ),
        ],
    ),
    (
        "Cost by tau (engine busy time)",
        "currencyUSD",
        [
            (
                "$/1M tokens {{variant}} tau={{tau}}",
                f"{_rate(m.BUSY_COST_USD_TOTAL, 'variant, tau')} / "
                f"sum by (variant, tau) (rate({m.BLOCK_LENGTH.name}_sum{{{SEL}}}[5m])) * 1e6",
            ),
        ],
    ),
]


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
    }


def dashboard() -> dict[str, Any]:
    """The dashboard model (Grafana JSON)."""
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                    for j, (legend, expr) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": "dmtd-platform",
        "title": "DMTD platform",
        "tags": ["dmtd"],
        "timezone": "utc",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                _variable("namespace", f"label_values({m.REQUESTS_TOTAL.name}, namespace)"),
                _variable(
                    "deployment",
                    f'label_values({m.REQUESTS_TOTAL.name}{{namespace=~"$namespace"}}, deployment)',
                ),
            ]
        },
        "panels": panels,
    }


def render_json() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the dashboard, or write it to the path given as the only argument."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        with open(args[0], "w", encoding="utf-8") as f:
            f.write(render_json())
    else:
        sys.stdout.write(render_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
