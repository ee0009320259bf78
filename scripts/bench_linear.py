"""The packed products alone (``torch.ops.dmtd.linear``): milliseconds for the 30 layers' four projections of SmolLM2
(distinct weights per layer, so that they stream from memory as in a decode step), for M = 1, 2, 3, 4 activation rows
(a plain step, a verified cycle's check over 2 and 3 positions, a small batch), in turns; medians and ÷ one row.
Compare builds by running it at two commits (the kernels rebuild on the first call after a source change).

    bash scripts/quiet.sh .venv/bin/python scripts/bench_linear.py --format bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dmtd.engine import lowbit

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="bf16", help="packed format: bf16, int8, int4, i8dot")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--turns", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lowbit.load_kernels()
    gen = torch.Generator().manual_seed(0)
    ws = [[lowbit.pack(torch.randn(n, k, generator=gen) * k ** -0.5, args.format) for k, n in SHAPES]
          for _ in range(args.layers)]
    rows = [int(m) for m in args.rows.split(",")]
    times: dict[int, list[float]] = {m: [] for m in rows}
    for t in range(args.turns):
        for m in (rows if t % 2 == 0 else rows[::-1]):
            xs = [torch.randn(m, k, generator=gen) for k, _ in SHAPES]
            s = time.perf_counter()
            for layer in ws:
                for x, w in zip(xs, layer):
                    w.project(x)
            times[m].append((time.perf_counter() - s) * 1e3)
    base = statistics.median(times[rows[0]])
    for m in rows:
        med = statistics.median(times[m])
        print(f"{args.format:6s} rows {m}  {med:7.2f} ms  ÷ {rows[0]} row{'s' if rows[0] > 1 else ''} {med / base:.3f}")


if __name__ == "__main__":
    main()
