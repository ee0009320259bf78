"""Decode attention alone (``torch.ops.dmtd.attend``, kernels/attend.h): microseconds per call, one layer of
SmolLM2's shape (9 query heads over 3 KV heads of 64), for 1, 2 and 3 rows of one sequence (a plain step, a verified
cycle's check over 2 and 3 positions) at several context lengths; shapes interleaved, medians printed. Compare
builds by running it at two commits (the kernels rebuild on the first call after a source change).

    bash scripts/quiet.sh .venv/bin/python scripts/bench_attend.py --context 100,170,400,1000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dmtd.engine.ops  # noqa: F401 — registers the dmtd ops' schemas
from dmtd.engine.lowbit import load_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="100,170,400,1000", help="keys of the last row (comma list)")
    ap.add_argument("--rows", default="1,2,3")
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_kernels()
    nkv, hd, nh, maxlen = 3, 64, 9, 4096
    kc, vc = torch.randn(1, nkv, maxlen, hd), torch.randn(1, nkv, maxlen, hd)
    contexts = [int(c) for c in args.context.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.turns):
        for ctx in contexts:
            for b in rows:
                q = torch.randn(b, nh, hd)
                slots, lens = torch.zeros(b, dtype=torch.long), torch.arange(ctx + 1 - b, ctx + 1)
                t = time.perf_counter()
                for _ in range(20):
                    torch.ops.dmtd.attend(q, kc, vc, slots, lens, hd ** -0.5)
                times.setdefault((ctx, b), []).append((time.perf_counter() - t) / 20 * 1e6)
    for ctx in contexts:
        print(f"context {ctx:5d}  " + "  ".join(f"{b} row{'s' if b > 1 else ' '} "
                                                f"{statistics.median(times[(ctx, b)]):6.1f} us" for b in rows))


if __name__ == "__main__":
    main()
