"""``dmtd bench serve``'s printed tables and its plot: the rows a run measured (``dmtd.bench.serve_bench``), each
table over the rows that carry its figures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]
# a column: its header, its width and how a row's value is written
Column = tuple[str, int, Callable[[Row], str]]


def _key(name: str, fmt: str = ".1f") -> Callable[[Row], str]:
    return lambda r: format(r[name], fmt)


_N: Column = ("N", 4, lambda r: str(r["concurrency"]))
_POLICY: Column = ("policy", 9, lambda r: r["policy"])


def print_table(title: str, columns: list[Column], rows: list[Row]) -> None:
    """``rows`` under a header line (after ``title``, when given), each column right-aligned to its width."""
    if not rows:
        return
    print("\n" + (title + ":\n" if title else "") + " ".join(f"{h:>{w}}" for h, w, _ in columns))
    for r in rows:
        print(" ".join(f"{cell(r):>{w}}" for _, w, cell in columns))


def print_tables(rows: list[Row]) -> list[Row]:
    """Every table a run's rows fill; returns the rows with per-stage figures (the stages plot's)."""
    print_table("", [("mode", 6, lambda r: r["mode"]),
                     ("N/rate", 6, lambda r: str(r.get("concurrency", r.get("rate")))), _POLICY,
                     ("tok/s", 7, _key("tokens_per_s")),
                     ("×τ=1", 5, lambda r: format(r.get("speedup_vs_tau1", 0), ".2f")),
                     ("TTFT p95", 9, _key("ttft_p95_ms", ".0f")), ("ITL p50", 8, _key("itl_p50_ms")),
                     ("ITL p95", 8, _key("itl_p95_ms")), ("e2e p95", 8, _key("e2e_p95_ms", ".0f")),
                     ("SLO", 5, _key("slo_attainment", ".0%"))], rows)
    print_table("", [_N, _POLICY, ("stack tok/s", 11, _key("tokens_per_s")),
                     ("engine tok/s", 12, _key("engine_tokens_per_s")),
                     ("efficiency", 10, _key("stack_efficiency", ".2f")),
                     ("paired", 6, _key("stack_efficiency_paired", ".2f")),
                     ("TTFT p50 stack", 14, _key("ttft_p50_ms", ".0f")),
                     ("engine", 7, _key("engine_ttft_p50_ms", ".0f")),
                     ("ITL p50 stack", 13, _key("itl_p50_ms")), ("engine", 7, _key("engine_itl_p50_ms"))],
                [r for r in rows if "engine_tokens_per_s" in r])
    print_table("the engine under arrivals against static batches (the same requests, all N added together)",
                [_N, _POLICY, ("arrivals tok/s", 14, _key("engine_tokens_per_s")),
                 ("static tok/s", 12, _key("engine_static_tokens_per_s")),
                 ("ratio", 6, _key("arrivals_over_static", ".2f")),
                 ("paired", 6, _key("arrivals_over_static_paired", ".2f"))],
                [r for r in rows if "arrivals_over_static" in r])

    def cpu(part: str, width: int) -> Column:
        return part, width, lambda r: format(r["cpu_ms_per_token"][part], ".2f")

    print_table("CPU ms per token (stack processes; engine: the in-process engine's run)",
                [_N, _POLICY, cpu("replica", 8), cpu("gateway", 8), cpu("client", 7), cpu("ray", 6),
                 ("total", 7, lambda r: format(sum(r["cpu_ms_per_token"].values()), ".2f")),
                 ("engine", 7, lambda r: format(r.get("engine", {}).get("cpu_ms_per_token", 0.0), ".2f"))],
                [r for r in rows if "cpu_ms_per_token" in r])
    staged = [r for r in rows if r.get("stages", {}).get("requests")]
    if staged:
        from dmtd.bench.serve_stages import STAGES

        print_table("ms per token by stage (from the spans)",
                    [_N, _POLICY, *((s, 15, lambda r, s=s: format(r["stages"]["ms_per_token"][s], ".2f"))
                                    for s in STAGES)], staged)

    def step(r: Row, name: str) -> float:
        return float(r["stages"]["ms_per_token"][name])

    print_table("engine steps, ms per token: wall and the engine thread's CPU, in the replica and in-process",
                [_N, _POLICY, ("stack wall", 10, lambda r: format(step(r, "engine_step"), ".2f")),
                 ("stack CPU", 9, lambda r: format(step(r, "engine_step_cpu"), ".2f")),
                 ("not running", 11, lambda r: format(step(r, "engine_step") - step(r, "engine_step_cpu"), ".2f")),
                 ("engine wall", 11, lambda r: format(r["engine"]["step_ms_per_token"], ".2f")),
                 ("engine CPU", 10, lambda r: format(r["engine"]["step_cpu_ms_per_token"], ".2f"))],
                [r for r in staged if "step_ms_per_token" in r.get("engine", {})])
    return staged


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["mode"] == "closed"]
    conc = sorted({r["concurrency"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(policies))
    for j, p in enumerate(policies):
        sel = [next(r for r in rows if r["policy"] == p and r["concurrency"] == c) for c in conc]
        xs = [i + j * width for i in range(len(conc))]
        a.bar(xs, [r["tokens_per_s"] for r in sel], width, label=p)
        b.bar(xs, [r["itl_p95_ms"] for r in sel], width, label=p)
    for ax, title in ((a, "output tokens/s"), (b, "per-token ITL p95 (ms)")):
        ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(conc))], [f"N={c}" for c in conc])
        ax.set_title(title)
    b.axhline(result["itl_slo_ms"], color="red", lw=1, ls="--", label="ITL SLO")
    a.legend()
    b.legend()
    fig.suptitle(f"dmtd bench serve — variant {result['variant']}, {result['max_new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
