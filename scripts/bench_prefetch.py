"""The AVX2 products' software prefetch distance, side by side in one process (``dmtd::set_prefetch``): the shipped
variant's exact profile at a context of ~120 tokens, in turns over the distances so that the machine's drift falls on
all alike; each turn times the head's check over 1 and 2 positions (a plain step, a τ = 2 check) and a draft pass.
Prints the medians and each distance ÷ the first one. One process, not one per build: two processes differ by a few
per cent in how their weights land in memory, which is the size of the effect. ``--chat-rounds R`` then runs the
eight chat prompts of `make demo` (≤ 96 tokens) at τ = 1 and with the default exact profile (adaptive, τ = 3) under
each distance, in turns, R times over: tokens/s of both and their ratio.

    bash scripts/quiet.sh .venv/bin/python scripts/bench_prefetch.py --distances 0,512,1024,2048
    bash scripts/quiet.sh .venv/bin/python scripts/bench_prefetch.py --distances 0,1024,2048 --turns 0 --chat-rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dmtd.bench.exact_bench import CHATS
from dmtd.cli import SHIPPED_VARIANTS
from dmtd.engine.config import EngineConfig
from dmtd.engine.lowbit import load_kernels
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import EngineSpec, build_engine, engine_spec

PASSES = ("check 1", "check 2", "draft")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distances", default="0,1024", help="bytes, comma-separated (0: no software prefetch)")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3, help="passes of each kind per turn")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chat-rounds", type=int, default=0, help="then the chat prompts at τ = 1 and τ = 3, R rounds")
    args = ap.parse_args()
    torch.set_num_threads(2)
    load_kernels()
    dists = [int(d) for d in args.distances.split(",")]
    spec = engine_spec(None, "smollm2-135m-dmtd", None, dtype=getattr(torch, args.dtype), device="cpu",
                       search_dirs=[SHIPPED_VARIANTS])
    eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype=args.dtype,
                                          adaptive_drafts=False))
    rid = eng.add_request(eng.encode([{"role": "user", "content": "Write a short story about a lighthouse keeper."}]),
                          SamplingParams(max_new_tokens=4000, cycle_len=2, exact=True, ignore_eos=True,
                                         min_confidence=0.0))
    for _ in range(120):
        eng.step()
    while eng.seqs[rid].drafts:
        eng.step()
    seq, runner = eng.seqs[rid], eng.runner
    tail = seq.num_tail_cached

    def check(n: int) -> None:
        seq.drafts = [seq.token_ids[-1]] * (n - 1)
        runner.verify([seq])
        seq.drafts = []

    def draft() -> None:
        seq.num_tail_cached = seq.draft_position - 1  # the head's position and the new one, as in a steady cycle
        runner.draft([seq])
        seq.num_tail_cached = tail

    runs = {"check 1": lambda: check(1), "check 2": lambda: check(2), "draft": draft}
    times: dict[tuple[int, str], list[float]] = {(d, k): [] for d in dists for k in runs}
    x = torch.zeros(1)
    for t in range(args.turns):
        for d in (dists if t % 2 == 0 else dists[::-1]):
            torch.ops.dmtd.set_prefetch(x, d)
            for k, f in runs.items():
                for _ in range(args.reps):
                    s = time.perf_counter()
                    f()
                    times[(d, k)].append((time.perf_counter() - s) * 1e3)
    if args.turns:
        med = {d: {k: statistics.median(times[(d, k)]) for k in runs} for d in dists}
        print(f"{'prefetch':>9s} " + " ".join(f"{k + ' ms':>10s}" for k in PASSES)
              + "   " + " ".join(f"{k + ' ÷ first':>15s}" for k in PASSES))
        for d in dists:
            print(f"{d:9d} " + " ".join(f"{med[d][k]:10.2f}" for k in PASSES) + "   "
                  + " ".join(f"{med[d][k] / med[dists[0]][k]:15.3f}" for k in PASSES))
    if args.chat_rounds:
        chats(spec, args.dtype, dists, args.chat_rounds)
    torch.ops.dmtd.set_prefetch(x, 2048)  # the default


def chats(spec: EngineSpec, dtype: str, dists: list[int], rounds: int) -> None:
    eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype=dtype,
                                          adaptive_drafts=True))
    x = torch.zeros(1)

    def tok_s(prompt: str, tau: int) -> float:
        r = eng.generate([[{"role": "user", "content": prompt}]],
                         SamplingParams(max_new_tokens=96, cycle_len=tau, exact=True, min_confidence=0.0))[0]
        return (len(r.token_ids) - 1) / r.decode_time_s

    for tau in (3, 1):  # warm-up: first runs of each shape pay one-off costs
        tok_s(CHATS[0], tau)
    res: dict[int, dict[int, list[float]]] = {d: {1: [], 3: []} for d in dists}
    for rnd in range(rounds):
        for i, prompt in enumerate(CHATS):
            for d in (dists if (i + rnd) % 2 == 0 else dists[::-1]):
                torch.ops.dmtd.set_prefetch(x, d)
                for tau in (1, 3):
                    res[d][tau].append(tok_s(prompt, tau))
    for d in dists:
        one, three = res[d][1], res[d][3]
        print(f"prefetch {d:5d}: τ = 1 {statistics.mean(one):.1f} tok/s, exact τ = 3 {statistics.mean(three):.1f} "
              f"tok/s, mean ratio {statistics.mean(b / a for a, b in zip(one, three)):.3f}")


if __name__ == "__main__":
    main()
