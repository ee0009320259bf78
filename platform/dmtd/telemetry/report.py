"""``dmtd cost report``: a ``dmtd bench serve --json`` result → what a daily token volume costs under an SLO,
DMTD policies against τ=1 side by side (JSON + PNG + HTML, and a table on stdout).

Per policy the operating point is the measured closed-loop row with the highest throughput that meets the
SLO (attainment ≥ target, and p95 TTFT / ITL within any stricter SLO given here); the arithmetic is
``dmtd.telemetry.cost``.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from dmtd.telemetry import cost
from dmtd.telemetry.config import DEFAULT_PRICES


def add_cost_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_json", help="result of `dmtd bench serve --json PATH`")
    p.add_argument("--daily-tokens", type=float, default=100e6, help="output tokens to serve per day")
    p.add_argument("--slo-attainment", type=float, default=0.95, help="share of requests that must meet the SLO")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="TTFT p95 bound (default: the bench's SLO)")
    p.add_argument("--itl-slo-ms", type=float, default=None, help="ITL p95 bound (default: the bench's SLO)")
    p.add_argument("--replica-type", default="cpu", help=f"price key: {', '.join(DEFAULT_PRICES)}")
    p.add_argument("--usd-per-gpu-hour", type=float, default=None, help="explicit price (wins over --replica-type)")
    p.add_argument("--gpus-per-replica", type=int, default=1)
    p.add_argument("--target-utilization", type=float, default=1.0,
                   help="fraction of measured throughput a replica is planned at")
    p.add_argument("--peak-to-mean", type=float, default=1.0, help="peak over mean traffic rate")
    p.add_argument("--out", default=None, help="output prefix (default: next to the bench JSON, '<name>-cost')")


def operating_point(rows: list[dict[str, Any]], attainment: float, ttft_slo_ms: float | None,
                    itl_slo_ms: float | None) -> tuple[dict[str, Any], bool]:
    """The fastest row meeting the SLO, and True; else the row with the best attainment, and False."""
    def meets(r: dict[str, Any]) -> bool:
        return (r["slo_attainment"] >= attainment - 1e-12
                and (ttft_slo_ms is None or r["ttft_p95_ms"] <= ttft_slo_ms)
                and (itl_slo_ms is None or r["itl_p95_ms"] <= itl_slo_ms))

    ok = [r for r in rows if meets(r) and r["tokens_per_s"] > 0]
    if ok:
        return max(ok, key=lambda r: r["tokens_per_s"]), True
    return max(rows, key=lambda r: (r["slo_attainment"], r["tokens_per_s"])), False


def build_report(bench: dict[str, Any], daily_tokens: float, slo_attainment: float = 0.95,
                 usd_per_gpu_hour: float = DEFAULT_PRICES["cpu"], gpus_per_replica: int = 1,
                 ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None,
                 target_utilization: float = 1.0, peak_to_mean: float = 1.0) -> dict[str, Any]:
    """The cost report as data (pure: no I/O)."""
    per_hour = cost.replica_usd_per_hour(usd_per_gpu_hour, gpus_per_replica)
    rows = [r for r in bench["rows"] if r["mode"] == "closed"] or list(bench["rows"])
    policies: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        row, meets = operating_point([r for r in rows if r["policy"] == policy], slo_attainment, ttft_slo_ms,
                                     itl_slo_ms)
        tok_s = row["tokens_per_s"]
        instances = cost.instances_needed(daily_tokens, tok_s, target_utilization, peak_to_mean)
        policies[policy] = {
            "meets_slo": meets, "concurrency": row.get("concurrency"), "tokens_per_s": tok_s,
            "slo_attainment": row["slo_attainment"], "ttft_p95_ms": row["ttft_p95_ms"],
            "itl_p95_ms": row["itl_p95_ms"],
            "gpu_seconds_per_request": cost.gpu_seconds_per_request(row["wall_s"], row["requests"],
                                                                    gpus_per_replica),
            "usd_per_million_tokens": cost.usd_per_million_tokens(per_hour, tok_s),
            "usd_per_slo_request": cost.usd_per_slo_request(per_hour, row["wall_s"], row["requests"],
                                                            row["slo_attainment"]),
            "instances": instances, "usd_per_month": cost.usd_per_month(instances, per_hour),
        }
    base = policies.get("tau1")
    for p in policies.values():
        if base is not None:
            p["saving_vs_tau1"] = cost.saving_vs_tau1(p["tokens_per_s"], base["tokens_per_s"])
            p["usd_per_month_saved_vs_tau1"] = base["usd_per_month"] - p["usd_per_month"]
    return {
        "variant": bench.get("variant"), "daily_tokens": daily_tokens, "slo_attainment_target": slo_attainment,
        "ttft_slo_ms": ttft_slo_ms if ttft_slo_ms is not None else bench.get("ttft_slo_ms"),
        "itl_slo_ms": itl_slo_ms if itl_slo_ms is not None else bench.get("itl_slo_ms"),
        "usd_per_gpu_hour": usd_per_gpu_hour, "gpus_per_replica": gpus_per_replica,
        "usd_per_replica_hour": per_hour, "target_utilization": target_utilization, "peak_to_mean": peak_to_mean,
        "hours_per_month": cost.HOURS_PER_MONTH, "policies": policies,
    }


COLUMNS = [("policy", "{}"), ("meets_slo", "{}"), ("concurrency", "{}"), ("tokens_per_s", "{:.1f}"),
           ("slo_attainment", "{:.0%}"), ("usd_per_million_tokens", "${:.2f}"), ("usd_per_slo_request", "${:.5f}"),
           ("gpu_seconds_per_request", "{:.2f}"), ("instances", "{}"), ("usd_per_month", "${:,.0f}"),
           ("saving_vs_tau1", "{:+.0%}")]


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, p in report["policies"].items():
        vals = {"policy": name, **p}
        out.append([("–" if vals.get(k) is None or (isinstance(vals.get(k), float) and math.isinf(vals[k]))
                     else f.format(vals[k])) for k, f in COLUMNS])
    return out


def format_table(report: dict[str, Any]) -> str:
    head = [k for k, _ in COLUMNS]
    body = table_rows(report)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["policies"])
    ps = [report["policies"][n] for n in names]
    colors = ["#888888" if n == "tau1" else "#2f6fdb" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [("$ per 1M output tokens", [p["usd_per_million_tokens"] for p in ps]),
              (f"$ per month for {report['daily_tokens']:,.0f} tokens/day", [p["usd_per_month"] for p in ps]),
              ("SLO attainment at the operating point", [p["slo_attainment"] for p in ps])]
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize=10)
        for b, p in zip(bars, ps):
            label = f"{p['instances']} inst." if "month" in title else ""
            if "SLO" in title:
                label = "meets" if p["meets_slo"] else "misses"
            ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=8)
    axes[2].axhline(report["slo_attainment_target"], color="red", lw=1, ls="--")
    axes[2].set_ylim(0, 1.05)
    fig.suptitle(f"dmtd cost report — variant {report['variant']}, ${report['usd_per_replica_hour']:.2f}/replica-hour")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_html(report: dict[str, Any], png: Path) -> str:
    img = base64.b64encode(png.read_bytes()).decode()  # self-contained: nothing loaded from elsewhere
    head = "".join(f"<th>{html.escape(k)}</th>" for k, _ in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in table_rows(report))
    r = report
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>dmtd cost report</title>
<style>body{{font:14px system-ui,sans-serif;margin:24px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style></head><body>
<h1>dmtd cost report — {html.escape(str(r['variant']))}</h1>
<p>{r['daily_tokens']:,.0f} output tokens/day; SLO: {r['slo_attainment_target']:.0%} of requests within TTFT
{r['ttft_slo_ms']} ms and per-token ITL p95 {r['itl_slo_ms']} ms; ${r['usd_per_gpu_hour']:.2f}/GPU-hour x
{r['gpus_per_replica']} GPU(s) per replica; {r['hours_per_month']:.0f} h/month.</p>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<p><img alt="cost report" src="data:image/png;base64,{img}"></p></body></html>
"""


def _finite(x: Any) -> Any:
    """JSON has no infinity: a cost with no compliant request is written as null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def run_cost_report(args: argparse.Namespace) -> dict[str, Any]:
    bench_path = Path(args.bench_json)
    bench = json.loads(bench_path.read_text())
    price = args.usd_per_gpu_hour if args.usd_per_gpu_hour is not None else DEFAULT_PRICES.get(args.replica_type)
    if price is None:
        raise SystemExit(f"unknown --replica-type {args.replica_type!r}; known: {', '.join(DEFAULT_PRICES)} "
                         "(or give --usd-per-gpu-hour)")
    report = build_report(bench, args.daily_tokens, args.slo_attainment, price, args.gpus_per_replica,
                          args.ttft_slo_ms, args.itl_slo_ms, args.target_utilization, args.peak_to_mean)
    prefix = Path(args.out) if args.out else bench_path.with_name(bench_path.stem + "-cost")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = {ext: prefix.with_name(prefix.name + "." + ext) for ext in ("json", "png", "html")}
    paths["json"].write_text(json.dumps(_finite(report), indent=2))
    plot_report(report, paths["png"])
    paths["html"].write_text(render_html(report, paths["png"]))
    print(format_table(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report
