"""What one more row costs a verified cycle's check: the same check pass at 1, 2 and 3 rows, on one engine state.

    bash scripts/quiet.sh .venv/bin/python scripts/check_rows.py

Runs the shipped variant's exact profile (bf16, fixed τ = 2) on a chat prompt of `make demo` until a check holds a
draft, then repeats that check with 0, 1 and 2 drafts, alternately (``--reps`` times each), and prints the median
milliseconds of the pass and of its parts: the encoding, thinking and decoding layer groups, the stash of the
tail path's input, the lm_head. Repeating a check rewrites the same KV positions, so every repetition sees the
same cache; alternating the row counts cancels the machine's drift out of the differences.

``--compare-loop`` also runs each check through the TorchScript layer loop (``dmtd.engine.decode_kernel``, the path
before ``dmtd::rows_layers``), alternating with the one-call layer groups, and prints both tables and their ratio:

    bash scripts/quiet.sh .venv/bin/python scripts/check_rows.py --compare-loop
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch

from dmtd.bench.exact_bench import CHATS
from dmtd.cli import SHIPPED_VARIANTS
from dmtd.engine.config import EngineConfig
from dmtd.engine.model import route_decoding_input
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec

PARTS = ("setup", "encoding layers", "thinking layers", "decoding layers", "stash", "lm_head", "pass")


def timed_check(runner: Any, seqs: list, times: dict[str, list[float]]) -> None:
    """``runner.verify(seqs)`` with a clock between its parts (the same calls, in the same order)."""
    self, m, d = runner, runner.model, runner.dmtd
    with torch.inference_mode():
        t = [time.perf_counter()]
        counts = [len(s.drafts) + 1 for s in seqs]
        pos, valid = self._right_aligned([s.draft_position for s in seqs], counts)
        R = pos.shape[1]
        ids = torch.zeros(len(seqs), R, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, R - counts[i]:] = torch.tensor([s.token_ids[-1], *s.drafts])
        ctx = self._context([s.slot for s in seqs], pos, valid)
        emb = m.embed_tokens(ids).to(self.dtype)
        t.append(time.perf_counter())
        h_enc = m.run_layers(emb, 0, d.thinking_start, ctx.cos, ctx.sin, self.kv, ctx, self.weights)
        t.append(time.perf_counter())
        h_think = m.run_layers(h_enc, d.thinking_start, d.decoding_start, ctx.cos, ctx.sin, self.kv, ctx,
                               self.weights)
        t.append(time.perf_counter())
        heads = torch.ones(pos.shape, dtype=torch.bool)
        xv = route_decoding_input(h_enc, h_think, heads, self.verifier.head_input)
        h = m.run_layers(xv, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.verify_kv, ctx,
                         self.verify_weights)
        t.append(time.perf_counter())
        xt = route_decoding_input(h_enc, h_think, heads, d.head_input).reshape(-1, h_enc.shape[-1])
        self.cache.stash[ctx.write_slots, ctx.write_pos] = xt if ctx.write_rows is None else xt[ctx.write_rows]
        t.append(time.perf_counter())
        self.logits(h)
        t.append(time.perf_counter())
    for k, name in enumerate(PARTS[:-1]):
        times[name].append(t[k + 1] - t[k])
    times["pass"].append(t[-1] - t[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--prompt", type=int, default=1, help="which of the demo's eight chat prompts")
    ap.add_argument("--after", type=int, default=40, help="measure at the first check with a draft from this one on")
    ap.add_argument("--compare-loop", action="store_true",
                    help="alternate with the TorchScript layer loop (model.fused_layers off) and compare")
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = engine_spec(None, "smollm2-135m-dmtd", None, dtype=torch.bfloat16, device="cpu",
                       search_dirs=[SHIPPED_VARIANTS])
    eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype="bfloat16",
                                          adaptive_drafts=False))
    runner, verify, seen = eng.runner, eng.runner.verify, [0]
    paths = [True, False] if args.compare_loop else [runner.model.fused_layers]
    every: dict[bool, dict[int, dict[str, list[float]]]] = {
        f: {r: collections.defaultdict(list) for r in (1, 2, 3)} for f in paths}
    times = every[paths[0]]

    def measure(seqs: list) -> None:
        s = seqs[0]
        drafts = list(s.drafts)
        for _ in range(args.reps):
            for fused in paths:
                runner.model.fused_layers = fused
                for rows in (1, 2, 3):
                    s.drafts = (drafts * 3)[: rows - 1]
                    timed_check(runner, seqs, every[fused][rows])
        runner.model.fused_layers = paths[0]
        s.drafts = drafts
        print(f"{CHATS[args.prompt]!r}, check at position {s.draft_position - len(drafts)}: median ms of "
              f"{args.reps} checks each, alternating")
        for fused in paths:
            t = every[fused]
            if len(paths) > 1:
                print("one call a layer group (dmtd::rows_layers)" if fused else "the TorchScript layer loop")
            print(f"{'':18s}" + "".join(f"{f'{r} row' + ('s' if r > 1 else ''):>10s}" for r in (1, 2, 3)))
            for name in PARTS:
                print(f"{name:18s}" + "".join(f"{1e3 * statistics.median(t[r][name]):10.3f}" for r in (1, 2, 3)))
            one = statistics.median(t[1]["pass"])
            print("pass ÷ 1 row      " + "".join(f"{statistics.median(t[r]['pass']) / one:10.3f}" for r in (1, 2, 3)))
        if len(paths) > 1:
            print("pass: one call ÷ loop" + "".join(
                f"{statistics.median(every[True][r]['pass']) / statistics.median(every[False][r]['pass']):7.3f}"
                for r in (1, 2, 3)))

    def wrapped(seqs: list) -> torch.Tensor:
        seen[0] += 1
        if seen[0] >= args.after and seqs[0].drafts and not times[1]["pass"]:
            measure(seqs)
        return verify(seqs)

    runner.verify = wrapped  # type: ignore[method-assign]
    eng.generate([[{"role": "user", "content": CHATS[args.prompt]}]], SamplingParams(
        max_new_tokens=96, cycle_len=2, exact=True, min_confidence=0.0))
    if not times[1]["pass"]:
        raise SystemExit("no check with a draft after --after checks: lower it")


if __name__ == "__main__":
    main()
