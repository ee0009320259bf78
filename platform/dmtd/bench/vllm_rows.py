"""The rows of ``dmtd bench serve --against vllm``: each vLLM configuration's figures per workload, the best of them,
ours beside it and the ratios, from the results ``vllm bench serve`` saved."""

from __future__ import annotations

from typing import Any

# (key in our rows, key in vllm bench serve's result, heading)
METRICS = (("tokens_per_s", "output_throughput", "tok/s"), ("ttft_mean_ms", "mean_ttft_ms", "TTFT mean"),
           ("ttft_p50_ms", "p50_ttft_ms", "TTFT p50"), ("itl_p50_ms", "p50_itl_ms", "ITL p50"),
           ("itl_p99_ms", "p99_itl_ms", "ITL p99"), ("tpot_p50_ms", "p50_tpot_ms", "TPOT p50"))
COUNTS = (("requests", "completed"), ("failed", "failed"), ("output_tokens", "total_output_tokens"),
          ("input_tokens", "total_input_tokens"), ("wall_s", "duration"))


def side_metrics(raw: dict[str, Any]) -> dict[str, Any]:
    """Our names for a ``vllm bench serve`` result's figures; a two-turn result (its second turn, the first under
    ``turn1``) also gives the first turn's tok/s and TTFT mean."""
    out = {k: raw.get(src) for k, src, _ in METRICS}
    out.update({k: raw.get(src) for k, src in COUNTS})
    if "turn1" in raw:
        out["turn1_tokens_per_s"] = raw["turn1"].get("output_throughput")
        out["turn1_ttft_mean_ms"] = raw["turn1"].get("mean_ttft_ms")
    return out


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """ours / vLLM per metric (tok/s: above 1 is faster; latencies: below 1 is faster); None where undefined."""
    out: dict[str, float | None] = {}
    for k, _, _ in METRICS:
        a, b = ours.get(k), theirs.get(k)
        out[k] = a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None
    return out


def best_config(by_config: dict[str, dict[str, Any]]) -> str | None:
    """The vLLM configuration with the highest output tok/s on one workload (the first of equals, in the order run);
    None when none has a figure."""
    scored = [(m["tokens_per_s"], -i, c) for i, (c, m) in enumerate(by_config.items())
              if isinstance(m.get("tokens_per_s"), int | float)]
    return max(scored)[2] if scored else None


def make_rows(results: dict[str, dict[str, list[dict[str, Any]]]], plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload: every vLLM configuration's figures (``results["vllm"][config][i]``), the best
    configuration's as ``vllm``, and as ``dmtd`` our run right after that configuration's
    (``results["dmtd"][config][i]``: the two sides measured in the same minutes), with the ratios."""
    rows = []
    for i, w in enumerate(plan):
        configs = {c: side_metrics(runs[i]) for c, runs in results["vllm"].items()}
        ours = {c: side_metrics(runs[i]) for c, runs in results["dmtd"].items()}
        best = best_config(configs) or next(iter(configs))
        rows.append({"workload": w["workload"], "concurrency": w["concurrency"], "num_prompts": w["num_prompts"],
                     "best": best, "vllm": configs[best], "dmtd": ours[best],
                     "ratio": ratios(ours[best], configs[best]), "vllm_configs": configs, "dmtd_runs": ours})
    return rows


def _fmt(v: Any, ratio: bool = False) -> str:
    if not isinstance(v, int | float):
        return "—"
    return f"{v:.2f}" if ratio else f"{v}" if isinstance(v, int) else f"{v:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Per workload: each vLLM configuration's line, ours beside the best one, then ours ÷ the best (ms; tok/s of
    output; a two-turn row's figures are its second turns')."""
    head = f"{'workload':>8} {'N':>3} {'side':>14} " + " ".join(f"{h:>9}" for _, _, h in METRICS) + f" {'out tok':>7}"
    lines = [head]

    def line(r: dict[str, Any], label: str, m: dict[str, Any]) -> str:
        return (f"{r['workload']:>8} {r['concurrency']:>3} {label:>14} "
                + " ".join(f"{_fmt(m[k]):>9}" for k, _, _ in METRICS) + f" {_fmt(m['output_tokens']):>7}")

    for r in rows:
        for c, m in r["vllm_configs"].items():
            lines.append(line(r, f"vLLM {c}" + ("*" if c == r["best"] else ""), m))
        lines.append(line(r, "dmtd", r["dmtd"]))
        lines.append(f"{'':>8} {'':>3} {'dmtd/best':>14} "
                     + " ".join(f"{_fmt(r['ratio'][k], True):>9}" for k, _, _ in METRICS))
    return "\n".join(lines)
