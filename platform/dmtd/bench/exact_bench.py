"""Exact-profile rows of ``dmtd bench engine``: verified cycles on a variant against its verifier alone.

Each row runs the same chat prompts, greedy, and reports tokens/s, the acceptance it rests on, and two
bounds from the same run: ``bound_tok_s`` (tokens ÷ the time spent in model passes — what the engine
would reach with no overhead around them) and ``bound_speedup`` (that rate ÷ the verifier's own pass
rate at τ = 1, i.e. tokens per cycle ÷ the measured cost per cycle in τ = 1 steps).
"""

from __future__ import annotations

import statistics
from typing import Any

from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams

CHATS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three tips for staying focused while studying?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a simple recipe for pancakes.",
    "Why do cats purr? Answer in a short paragraph.",
    "List five interesting facts about the moon.",
    "How does a refrigerator keep food cold?",
]


def chat_prompts(batch: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": CHATS[i % len(CHATS)]}] for i in range(batch)]


def run_exact(engine: LLMEngine, batch: int, tau: int, threshold: float, new_tokens: int,
              repeats: int) -> dict[str, Any]:
    """Best of ``repeats`` runs of ``batch`` chat prompts at ``tau`` (τ = 1: the verifier alone)."""
    best: dict[str, Any] = {"tok_s": 0.0}
    prompts = chat_prompts(batch)
    for _ in range(repeats):
        engine.pass_stats.clear()
        gate = engine.cycles.draft_gate.decisions
        before = dict(gate)
        res = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens + 1, tau=tau, exact=True,
                                                      min_confidence=threshold if tau > 1 else 0.0,
                                                      ignore_eos=True))
        wall = max(r.decode_time_s for r in res)
        tokens = sum(len(r.token_ids) - 1 for r in res)
        st = engine.pass_stats
        verify_calls, verify_s = st.get("verify", [0, 0.0])
        draft_calls, draft_s = st.get("draft", [0, 0.0])
        if tokens / wall <= best["tok_s"]:
            continue
        drafted = sum(r.num_drafted for r in res)
        accepted = sum(r.num_accepted for r in res)
        by_pos_d = [sum(r.drafted_by_pos[j] for r in res if len(r.drafted_by_pos) > j) for j in range(tau - 1)]
        by_pos_a = [sum(r.accepted_by_pos[j] for r in res if len(r.accepted_by_pos) > j) for j in range(tau - 1)]
        checks = sum(len(r.blocks) - 1 for r in res)  # the first block is the prefill's token
        best = {
            "tok_s": tokens / wall, "bound_tok_s": tokens / (verify_s + draft_s),
            "mean_block_len": tokens / max(checks, 1), "acceptance": accepted / drafted if drafted else None,
            "acceptance_by_pos": [a / d if d else None for a, d in zip(by_pos_a, by_pos_d)],
            "accepted_per_cycle": accepted / max(checks, 1), "drafted_per_cycle": drafted / max(checks, 1),
            "verify_s_per_call": verify_s / max(verify_calls, 1), "draft_s_per_call": draft_s / max(draft_calls, 1),
            "draft_threshold": threshold if tau > 1 else None,
            # the batch gate's windows in this run, by reason ("plain pays", "measure drafts", "retry", …)
            "gate_windows": {k: n - before.get(k, 0) for k, n in gate.items() if n > before.get(k, 0)},
        }
    best["pct_of_bound"] = best["tok_s"] / best["bound_tok_s"]
    return best


def add_exact_ratios(rows: list[dict[str, Any]]) -> None:
    """Speedups over the verifier alone (τ = 1) and the bound given the measured acceptance and pass costs."""
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["system"] == "exact1")
        r["speedup_vs_tau1"] = r["tok_s"] / base["tok_s"]  # best ÷ best
        # the median of each round's ratio to the same round's τ = 1 (rounds run every configuration once): on a
        # host whose speed drifts by ±20 % between runs, the best of a few runs each still read an identical plain
        # step 0.92x; the pairs cancel the drift
        r["paired_vs_tau1"] = statistics.median(x / y for x, y in zip(r["tok_s_rounds"], base["tok_s_rounds"]))
        r["bound_speedup"] = r["bound_tok_s"] / base["bound_tok_s"]
        step = base["verify_s_per_call"]  # one τ = 1 step of the verifier at this batch
        r["tail_cost"] = r["draft_s_per_call"] / step if r["tau"] > 1 else None
        r["check_cost"] = r["verify_s_per_call"] / step


def plot_exact(exact: dict[str, Any], path: Any) -> None:
    """Speedup over the verifier alone, measured and bound (given the measured acceptance), per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = exact["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == b]
        xs = range(len(sel))
        ax.bar(xs, [r["speedup_vs_tau1"] for r in sel], color="#2f9e6e", label="measured")
        ax.plot(xs, [r["bound_speedup"] for r in sel], "k_", markersize=22, mew=2, label="bound given acceptance")
        ax.set_xticks(list(xs), [r["system"].replace("exact", "τ=") + (f"\nacc {r['acceptance']:.2f}"
                                                                        if r["acceptance"] else "") for r in sel])
        ax.set_title(f"batch {b}")
        ax.set_ylabel("tokens/s × the base alone (τ = 1)")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0][0].legend(loc="upper left")
    fig.suptitle(f"exact profile on {exact['variant']['name']} (output = the {exact['variant']['verifier']} model's)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
