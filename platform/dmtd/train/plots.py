"""Text summary and PNG of a ``dmtd eval`` report."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def summary_lines(r: dict[str, Any]) -> list[str]:
    base = r["base"]
    lines = [f"variant {r['variant']}: base judge ppl {base['judge_ppl']:.3f}, base τ=1 {base['tok_s']:.1f} tok/s",
             "  τ | tail agree (floor) | head agree | NLL (base) | judge ppl (floor) | token agree | tok/s | "
             "speedup | block"]
    for tau, v in r["tau"].items():
        f = r["floor"]["tau"][tau]
        lines.append(f"  {tau} | {v['tail_agreement']:.3f} ({f['tail_agreement']:.3f}) | {v['head_agreement']:.3f} | "
                     f"{v['nll']:.3f} ({v['base_nll']:.3f}) | {v['judge_ppl']:.2f} ({f['judge_ppl']:.2f}) | "
                     f"{v['token_agreement']:.3f} | {v['tok_s']:.1f} | {v['speedup']:.2f}× | {v['mean_block_len']:.2f}")
    lines.append("  frontier (τ, min_confidence → judge ppl ratio to base, speedup over τ=1, mean block):")
    for p in r["frontier"]:
        lines.append(f"    τ={p['tau']} c={p['min_confidence']:.2f} → {p['ppl_ratio']:.3f}×, "
                     f"{p['speedup']:.2f}×, {p['mean_block_len']:.2f}")
    ex = r.get("exact")
    if ex:
        lines.append(f"  exact profile (verifier {ex['verifier']}, draft threshold {ex['draft_threshold']:g}; base τ=1 "
                     f"{ex['base_tau1_tok_s']:.1f} tok/s): τ | tokens = verifier's | acceptance | by tail position | "
                     "accepted/cycle | tok/s | speedup")
        for tau, v in ex["tau"].items():
            def f(x: float | None) -> str:
                return "–" if x is None else f"{x:.2f}"
            lines.append(f"    {tau} | {v['tokens_match']:.0%} | {f(v['acceptance'])} | "
                         f"{' '.join(f(a) for a in v['acceptance_by_pos'])} | {f(v['accepted_per_cycle'])} | "
                         f"{v['tok_s']:.1f} | {v['speedup_vs_base_tau1']:.2f}×")
    op = r.get("operating_point")
    lines.append("  operating point: " + ("none within 1.15× of the base's judge perplexity" if op is None else
                 f"τ={op['tau']} min_confidence={op['min_confidence']} ({op['ppl_ratio']:.3f}× ppl, "
                 f"{op['speedup']:.2f}× speed, aim {'met' if op['meets_aim'] else 'not met'})"))
    return lines


def plot_report(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = [int(t) for t in r["tau"]]
    v = [r["tau"][str(t)] for t in taus]
    f = [r["floor"]["tau"][str(t)] for t in taus]
    fig, ax = plt.subplots(1, 4, figsize=(18, 4.2))
    ax[0].plot(taus, [x["tail_agreement"] for x in v], "o-", label="variant")
    ax[0].plot(taus, [x["tail_agreement"] for x in f], "s--", label="floor (untrained)")
    ax[0].set(title="teacher-forced tail top-1 agreement", xlabel="τ", ylim=(0, 1))
    ax[1].semilogy(taus, [x["judge_ppl"] for x in v], "o-", label="variant")
    ax[1].semilogy(taus, [x["judge_ppl"] for x in f], "s--", label="floor")
    ax[1].axhline(r["base"]["judge_ppl"], color="k", lw=1, label="base greedy")
    ax[1].set(title="judge perplexity (base model)", xlabel="τ")
    ax[2].plot([1, *taus], [r["base"]["tok_s"], *[x["tok_s"] for x in v]], "o-")
    ax[2].set(title="batch-1 decode tokens/s", xlabel="τ")
    for tau in sorted({p["tau"] for p in r["frontier"]}):
        pts = [p for p in r["frontier"] if p["tau"] == tau]
        ax[3].plot([p["speedup"] for p in pts], [p["ppl_ratio"] for p in pts], "o-", label=f"τ={tau}")
        for p in pts:
            ax[3].annotate(f"{p['min_confidence']:g}", (p["speedup"], p["ppl_ratio"]), fontsize=7)
    ax[3].axhline(1.15, color="r", lw=1, ls=":", label="1.15× base ppl")
    ax[3].axvline(1.3, color="g", lw=1, ls=":", label="1.3× speed")
    ax[3].set(title="frontier: min_confidence sweep", xlabel="speedup over τ=1", ylabel="judge ppl / base")
    for a in ax:
        a.grid(alpha=0.3)
    for a in (ax[0], ax[1], ax[3]):
        a.legend(fontsize=8)
    fig.suptitle(f"dmtd eval: {r['variant']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_curve(log: Path) -> dict[int, dict[str, float]]:
    """Held-out tail agreement by τ at each evaluated step of a run's ``log.jsonl`` (the last entry per step)."""
    import json

    out: dict[int, dict[str, float]] = {}
    if not log.is_file():
        return out
    for line in log.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill; the next resume rewrites the log
        if isinstance(d, dict) and isinstance(d.get("eval"), dict):
            out[int(d["step"])] = {str(k): float(v) for k, v in d["eval"].items()}
    return dict(sorted(out.items()))


def plot_curve(log: Path, path: Path, title: str = "") -> None:
    """PNG of a run's held-out tail agreement by τ against optimizer step (and tokens seen when logged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = read_curve(log)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    taus = sorted({t for v in curve.values() for t in v}, key=int)
    for t in taus:
        pts = [(s, v[t]) for s, v in curve.items() if t in v]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"τ = {t}")
    ax.set(title=f"held-out tail top-1 agreement with the base {title}".strip(), xlabel="optimizer step",
           ylabel="agreement", ylim=(0, 1))
    ax.grid(alpha=0.3)
    if taus:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
