"""``dmtd bench engine``: HF generate vs our engine at τ=1 vs DMTD τ=2..4, side by side, with roofline bounds."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dmtd.bench.exact_bench import add_exact_ratios, chat_prompts, plot_exact, run_exact
from dmtd.bench.roofline import bound_tok_s, measure_rates
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.variants.loader import load_model

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "faster and more cheaply than ever before. Within decades, presses spread across Europe, and "
)


def prompt_ids(tokenizer: Any, length: int) -> list[int]:
    ids = list(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False))
    while len(ids) < length:
        ids += ids
    return ids[:length]


def bench_hf(path: Path, ids: list[int], batch: int, new_tokens: int, repeats: int) -> float:
    """Decode tokens/s of HF ``generate`` (greedy): (t(N+1) − t(1)) over N·batch tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    x = torch.tensor([ids] * batch)

    def run(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            with torch.inference_mode():
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
            best = min(best, time.perf_counter() - t)
        return best

    return new_tokens * batch / (run(new_tokens + 1) - run(1))


def bench_engine(engine: LLMEngine, ids: list[int], batch: int, tau: int, new_tokens: int, repeats: int) -> dict:
    best: dict[str, Any] = {"tok_s": 0.0}
    for _ in range(repeats):
        res = engine.generate([ids] * batch, SamplingParams(max_new_tokens=new_tokens + 1, cycle_len=tau,
                                                            ignore_eos=True))
        t = max(r.decode_time_s for r in res)
        tok_s = sum(len(r.token_ids) - 1 for r in res) / t
        if tok_s > best["tok_s"]:
            best = {"tok_s": tok_s, "mean_block_len": sum(r.mean_block_len for r in res) / len(res)}
    return best


def run_engine_bench(args: argparse.Namespace) -> dict:
    taus = [int(t) for t in str(args.taus).split(",") if t]
    batches = [int(b) for b in str(args.batch_sizes).split(",") if b]
    if args.draft_threshold is not None and not 0.0 <= args.draft_threshold <= 1.0:  # NaN fails too
        raise RequestError("--draft-threshold", f"must be in [0, 1], got {args.draft_threshold}")
    torch.manual_seed(0)
    print("measuring this machine's memory bandwidth and matmul throughput ...")
    rates = measure_rates()
    print(f"  copy {rates.copy_gb_s:.1f} GB/s, batch-1 matvec {rates.matvec_gb_s:.1f} GB/s, "
          f"fp32 matmul {rates.matmul_gflop_s:.0f} GFLOP/s")
    lm = load_model(args.model)
    cfg = lm.config
    dmtd = DMTDConfig.plain(cfg.num_layers, args.decoding_layers, tau_max=max(taus + [1]))
    ids = prompt_ids(lm.tokenizer, args.prompt_len)
    context = args.prompt_len + args.new_tokens // 2
    engine = LLMEngine(lm.model, None, dmtd, EngineConfig(max_num_seqs=max(batches),
                                                          max_model_len=args.prompt_len + args.new_tokens + 8))
    rows: list[dict[str, Any]] = []
    jobs = [(b, s) for b in batches for s in (([] if args.no_hf else ["hf"]) + ["engine"] + [f"dmtd{t}" for t in taus])]
    for b, system in tqdm(jobs, desc="bench engine", unit="config"):
        tau = 1 if system in ("hf", "engine") else int(system[4:])
        bound = bound_tok_s(cfg, dmtd if tau > 1 else None, tau, b, context, rates)
        if system == "hf":
            r = {"tok_s": bench_hf(lm.path, ids, b, args.new_tokens, args.repeats), "mean_block_len": 1.0}
        else:
            r = bench_engine(engine, ids, b, tau, args.new_tokens, args.repeats)
        rows.append({"batch": b, "system": system, "tau": tau, **r, **bound})
    add_ratios(rows, batches)
    hf_rows = {r["batch"]: r for r in rows if r["system"] == "hf"}
    for r in rows:
        if r["batch"] in hf_rows:
            r["speedup_vs_hf"] = r["tok_s"] / hf_rows[r["batch"]]["tok_s"]
    exact_rows, variant = exact_section(args, batches)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, **rates.to_dict()},
        "model": str(lm.path), "num_layers": cfg.num_layers, "decoding_layers": args.decoding_layers,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": "float32", "rows": rows,
        "exact": {"variant": variant, "rows": exact_rows} if exact_rows else None,
    }
    print_table(result)
    if exact_rows:
        print_exact_table(result["exact"])
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        plot_path = Path(args.plot) if args.plot else path.with_suffix(".png")
        plot(result, plot_path)
        print(f"wrote {path} and {plot_path}")
        if exact_rows:
            exact_png = plot_path.with_name(plot_path.stem + "_exact.png")
            plot_exact(result["exact"], exact_png)
            print(f"wrote {exact_png}")
    return result


def exact_section(args: argparse.Namespace, batches: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Exact-profile rows on the variant (verified cycles), each batch with its verifier-alone τ = 1 row."""
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    names = sorted(p.parent.name for p in SHIPPED_VARIANTS.glob("*/variant.json"))
    name = args.variant or (names[0] if names else "none")
    taus = [int(t) for t in str(args.exact_taus).split(",") if t]
    if name == "none" or not taus:
        return [], None
    spec = engine_spec(args.model, name, search_dirs=[SHIPPED_VARIANTS])
    threshold = spec.min_confidence if args.draft_threshold is None else args.draft_threshold
    engine = build_engine(spec, EngineConfig(max_num_seqs=max(batches), max_model_len=1024))
    auto = build_engine(spec, EngineConfig(max_num_seqs=max(batches), max_model_len=1024, adaptive_drafts=True))
    for e in (engine, auto):
        e.generate(chat_prompts(1), SamplingParams(max_new_tokens=4, cycle_len=2, exact=True))  # warm-up
    rows = []
    tau_auto = max(taus + [spec.dmtd.tau_max])
    jobs = [(b, t, False) for b in batches for t in [1, *taus]] + [(b, tau_auto, True) for b in batches]
    for b, tau, adaptive in tqdm(jobs, desc="bench engine (exact)", unit="config"):
        r = run_exact(auto if adaptive else engine, b, tau, threshold, args.new_tokens, args.repeats)
        rows.append({"batch": b, "system": f"auto{tau}" if adaptive else f"exact{tau}", "tau": tau,
                     "adaptive_drafts": adaptive, **r})
    add_exact_ratios(rows)
    return rows, {"name": name, "verifier": engine.verifier_name, "draft_vocab": len(spec.draft_vocab or []) or None}


def print_exact_table(exact: dict[str, Any]) -> None:
    v = exact["variant"]
    print(f"\nexact profile on {v['name']} (verifier: {v['verifier']}; chat prompts, greedy; output = τ = 1's)")
    print(f"{'batch':>5} {'system':>8} {'tok/s':>8} {'×τ=1':>6} {'bound×':>7} {'of bound':>9} {'accept':>7} "
          f"{'acc/cyc':>7} {'tail c':>7} {'check c':>7}")
    for r in exact["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        tail = f"{r['tail_cost']:.2f}" if r["tail_cost"] is not None else "-"
        print(f"{r['batch']:>5} {r['system']:>8} {r['tok_s']:>8.1f} {r['speedup_vs_tau1']:>6.2f} "
              f"{r['bound_speedup']:>7.2f} {100 * r['pct_of_bound']:>8.0f}% {acc:>7} {r['accepted_per_cycle']:>7.2f} "
              f"{tail:>7} {r['check_cost']:>7.2f}")


def add_ratios(rows: list[dict[str, Any]], batches: list[int]) -> None:
    """Speedups over engine τ=1 (and over HF) next to the roofline bound's, per batch size."""
    for b in batches:
        base = next(r for r in rows if r["batch"] == b and r["system"] == "engine")
        for r in rows:
            if r["batch"] == b:
                r["speedup_vs_engine_tau1"] = r["tok_s"] / base["tok_s"]
                r["bound_speedup"] = r["bound_tok_s"] / base["bound_tok_s"]
                r["pct_of_bound_speedup_ratio"] = r["speedup_vs_engine_tau1"] / r["bound_speedup"]


def print_table(result: dict) -> None:
    print(f"\n{'batch':>5} {'system':>8} {'tok/s':>8} {'×τ=1':>6} {'bound×':>7} {'of bound':>9} "
          f"{'×HF':>6} {'bound tok/s':>11} {'block':>6}")
    for r in result["rows"]:
        hf = f"{r['speedup_vs_hf']:.2f}" if "speedup_vs_hf" in r else "-"
        print(f"{r['batch']:>5} {r['system']:>8} {r['tok_s']:>8.1f} {r['speedup_vs_engine_tau1']:>6.2f} "
              f"{r['bound_speedup']:>7.2f} {100 * r['pct_of_bound_speedup_ratio']:>8.0f}% {hf:>6} "
              f"{r['bound_tok_s']:>11.1f} {r['mean_block_len']:>6.2f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    systems = [s for s in dict.fromkeys(r["system"] for r in rows)]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sel = [next(r for r in rows if r["batch"] == b and r["system"] == s) for s in systems]
        xs = range(len(sel))
        ax.bar(xs, [r["speedup_vs_engine_tau1"] for r in sel], label="measured", color="#3b7dd8")
        ax.plot(xs, [r["bound_speedup"] for r in sel], "k_", markersize=22, mew=2, label="roofline bound")
        ax.set_xticks(list(xs), [s.replace("dmtd", "τ=") for s in systems])
        ax.set_title(f"batch {b}")
        ax.set_ylabel("decode speed × engine τ=1")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0][0].legend(loc="upper left")
    fig.suptitle(f"SmolLM2-135M fp32, D={result['decoding_layers']}, CPU {result['machine']['threads']} threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
