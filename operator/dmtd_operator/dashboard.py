"""The Grafana dashboard of the platform, built from `metric_names` so the names cannot drift.

`python -m dmtd_operator.dashboard PATH` writes it; the chart ships the output in
`helm/dmtd/files/grafana-dashboard.json` and a test keeps the two identical.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dmtd_operator import metric_names as m

SEL = 'namespace=~"$namespace",deployment=~"$deployment"'


def _p95_ms(hist: m.MetricName) -> str:
    return f"histogram_quantile(0.95, sum by (deployment, le) (rate({hist.name}_bucket{{{SEL}}}[5m]))) * 1000"


def _rate(counter: m.MetricName, by: str = "deployment") -> str:
    return f"sum by ({by}) (rate({counter.name}{{{SEL}}}[5m]))"


def _mean(hist: m.MetricName) -> str:
    rate = "sum by (deployment) (rate({name}{{" + SEL + "}}[5m]))"
    return f"{rate.format(name=hist.name + '_sum')} / {rate.format(name=hist.name + '_count')}"


USD_PER_HOUR = (
    f"sum by (deployment) ({m.REPLICAS_READY.name}{{{SEL}}}) * $gpus_per_replica * $usd_per_gpu_hour"
)

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Latency SLOs",
        "ms",
        [
            ("TTFT p95 {{deployment}}", _p95_ms(m.TTFT_SECONDS)),
            ("ITL p95 {{deployment}}", _p95_ms(m.ITL_SECONDS)),
        ],
    ),
    (
        "Throughput",
        "short",
        [
            ("tokens/s {{deployment}}", _rate(m.GENERATED_TOKENS_TOTAL)),
            ("requests/s {{deployment}}", _rate(m.REQUESTS_TOTAL)),
            ("queued {{deployment}}", f"sum by (deployment) ({m.QUEUE_DEPTH.name}{{{SEL}}})"),
        ],
    ),
    (
        "tau and block length k",
        "short",
        [
            ("tau max {{deployment}}", f"avg by (deployment) ({m.TAU_MAX.name}{{{SEL}}})"),
            ("tau min {{deployment}}", f"avg by (deployment) ({m.TAU_MIN.name}{{{SEL}}})"),
            ("mean k {{deployment}}", _mean(m.BLOCK_LENGTH)),
        ],
    ),
    (
        "Replicas, batch and GPU utilisation",
        "short",
        [
            ("ready replicas {{deployment}}", f"sum by (deployment) ({m.REPLICAS_READY.name}{{{SEL}}})"),
            ("mean batch {{deployment}}", f"avg by (deployment) ({m.BATCH_SIZE.name}{{{SEL}}})"),
            ("GPU util {{deployment}}", f"avg by (deployment) ({m.GPU_UTILIZATION.name}{{{SEL}}})"),
        ],
    ),
    (
        "Cost",
        "currencyUSD",
        [
            ("$/hour {{deployment}}", USD_PER_HOUR),
            (
                "$/1M tokens {{deployment}}",
                f"({USD_PER_HOUR}) / ({_rate(m.GENERATED_TOKENS_TOTAL)} * 3600) * 1e6",
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


def _textbox(name: str, value: str, label: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "textbox",
        "label": label,
        "query": value,
        "current": {"text": value, "value": value},
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
                _textbox("usd_per_gpu_hour", "2.5", "$ per GPU-hour"),
                _textbox("gpus_per_replica", "1", "GPUs per replica"),
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
