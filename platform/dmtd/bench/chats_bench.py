"""``dmtd bench exact``: the exact profile on the eight chat prompts of `dmtd bench engine` (none of them in the
training corpus), or those of ``--chat-file``: per prompt, the τ = 1 run and each configuration on one engine,
greedy, up to 96 new tokens (EOS ends a request, as in `dmtd generate`); prints speed ÷ τ = 1, drafts accepted /
made, and checks that the tokens equal τ = 1's.

    .venv/bin/dmtd bench exact --configs a3:0,f2:0 --dtype bfloat16 --draft-quants auto,none

A configuration is ``<a|s|t|n|f><tau>:<draft threshold>``: ``a`` adaptive drafts (the default of `dmtd generate`),
``s`` adaptive with the drafts scoring the draft vocabulary alone (``EngineConfig.context_vocab`` off: not the
prompt's and the answer's own ids outside it), ``t`` adaptive with the tails' drafts only
(``EngineConfig.context_drafts`` off: no prompt-lookup or phrase-table cycles), ``n`` adaptive without the variant's
phrase table (``EngineConfig.phrase_drafts`` off), ``f`` fixed (up to τ − 1 drafts a cycle, tails
only). Each prompt runs its configurations right after its own τ = 1 run, so machine drift between prompts cancels in
the ratios; ``--rounds`` repeats the whole sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from dmtd.bench.exact_bench import CHATS
from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.paths import SHIPPED_VARIANTS


def add_chats_bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--configs", default="a3:0,f2:0")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--draft-quants", default="auto", help="drafts' weights, side by side: auto, none, int8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", default="smollm2-135m-dmtd",
                    help="variants side by side (shipped names or directories), comma-separated; the first one's "
                    "τ = 1 run is every configuration's reference")
    ap.add_argument("--chat-file", default=None, help="one chat prompt a line instead of the eight (e.g. "
                    "corpora/short-chats-val.txt: a validation set to choose settings by, the demo's prompts a test)")
    ap.add_argument("--json", default=None, help="write per-prompt results here")
    ap.add_argument("--png", default=None, help="plot per-prompt speedups (mean over rounds) here")


def run_chats_bench(args: argparse.Namespace) -> None:
    torch.set_num_threads(2)
    prompts = [ln.strip() for ln in Path(args.chat_file).read_text().splitlines() if ln.strip()] if args.chat_file \
        else list(CHATS)
    variants = args.variants.split(",")
    specs = {v: engine_spec(None, v, None, dtype=getattr(torch, args.dtype), device="cpu",
                            search_dirs=[SHIPPED_VARIANTS]) for v in variants}
    dqs = args.draft_quants.split(",")
    cfg = EngineConfig(max_num_seqs=1, max_model_len=4096, dtype=args.dtype)
    modes = sorted({c[0] for c in args.configs.split(",")} | {"f"})
    engines = {(v, a, dq): build_engine(specs[v], dataclasses.replace(cfg, adaptive_drafts=a != "f",
                                                                      context_vocab=a != "s", draft_quant=dq,
                                                                      context_drafts=a != "t",
                                                                      phrase_drafts=a != "n"))
               for v in variants for a in modes for dq in dqs}
    configs = [(c + (f"/{dq}" if len(dqs) > 1 else "") + (f"@{Path(v).name}" if len(variants) > 1 else ""),
                (v, c[0], dq), int(c[1:].split(":")[0]), float(c.split(":")[1]))
               for v in variants for dq in dqs for c in args.configs.split(",")]

    def run(engine: tuple[str, str, str], prompt: str, tau: int,
            threshold: float) -> tuple[list[int], float, int, int, int, int]:
        r = engines[engine].generate([[{"role": "user", "content": prompt}]], SamplingParams(
            max_new_tokens=args.max_new_tokens, tau=tau, exact=True, min_confidence=threshold))[0]
        return (r.token_ids, (len(r.token_ids) - 1) / r.decode_time_s, r.num_accepted, r.num_drafted,
                r.num_context_accepted, r.num_context_drafted)

    for key in engines:  # warm-up: first runs of each shape pay one-off costs
        run(key, prompts[0], 3, 0.0)
    speed: dict[str, list[float]] = {c[0]: [] for c in configs}  # name: speed ÷ τ = 1, per prompt and round
    runs: list[dict] = []
    identical = total = 0
    for rnd in range(args.rounds):
        for prompt in prompts:
            ref, base, *_ = run((variants[0], "f", dqs[0]), prompt, 1, 0.0)
            line = f"{prompt[:34]:34s} {len(ref) - 1:3d} tok"
            for name, key, tau, threshold in configs:
                ids, tok_s, acc, made, cacc, cmade = run(key, prompt, tau, threshold)
                identical += ids == ref
                total += 1
                speed[name].append(tok_s / base)
                runs.append({"round": rnd + 1, "prompt": prompt, "config": name, "tokens": len(ref) - 1,
                             "speedup": tok_s / base, "accepted": acc, "drafted": made, "identical": ids == ref,
                             "context_accepted": cacc, "context_drafted": cmade})
                line += f" | {name} {tok_s / base:.2f}x {acc}/{made}" + (f" ({cacc}/{cmade} context)" if cmade else "")
            print(f"[{rnd + 1}] {line}", flush=True)
    print(f"tokens identical to τ = 1's: {identical} of {total} runs ({args.dtype})")
    for name, xs in speed.items():
        acc, made, cacc, cmade = (sum(r[k] for r in runs if r["config"] == name)
                                  for k in ("accepted", "drafted", "context_accepted", "context_drafted"))
        print(f"{name}: mean {statistics.mean(xs):.3f}x  median {statistics.median(xs):.3f}x  "
              f"min {min(xs):.2f}x  max {max(xs):.2f}x  accepted {acc}/{made} = {acc / max(made, 1):.3f}"
              + (f", of them context drafts {cacc}/{cmade}" if cmade else ""))
    for name, key, *_ in configs:  # the same requests: fewer passes of a kind is what a configuration saved (the
        # configurations of one letter share an engine: their passes are counted together)
        passes = {k: int(v[0]) for k, v in engines[key].pass_stats.items()}
        print(f"{name}: passes (warm-up included) " + ", ".join(f"{k} {n}" for k, n in sorted(passes.items())))
    if args.json:
        command = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "command": command, "runs": runs}, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        plot(runs, [c[0] for c in configs], prompts, args.png)
        print(f"wrote {args.png}")


def plot(runs: list[dict], names: list[str], prompts: list[str], path: str) -> None:
    """Per prompt, each configuration's speed ÷ τ = 1 (mean over rounds), with the issue's 1.3× aim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for k, name in enumerate(names):
        ys = [statistics.mean(r["speedup"] for r in runs if r["prompt"] == p and r["config"] == name) for p in prompts]
        ax.bar([i + k * width for i in range(len(prompts))], ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(prompts))], [p[:22] + "…" for p in prompts], rotation=20,
                  ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.3, color="red", lw=0.8, ls="--", label="aim 1.3×")
    ax.set_ylabel("tokens/s ÷ τ = 1 (same engine, same prompt)")
    ax.set_title("exact profile on chat prompts outside the corpus (output = τ = 1's tokens)")
    ax.legend(fontsize=8, ncol=len(names) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

