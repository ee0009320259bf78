"""The bf16 kernel against torch's own bf16 matmul (oneDNN; AMX tiles where the CPU has them) by the number of
rows, for SmolLM2's projection shapes: where ``dmtd.engine.ops.AMX_MIN_ROWS`` comes from.

    bash scripts/quiet.sh .venv/bin/python scripts/bench_amx_rows.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dmtd.engine.lowbit import load_kernels, pack
from dmtd.engine.ops import AMX_MIN_ROWS, cpu_flags


def ms(f, n: int = 40) -> float:
    for _ in range(5):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    load_kernels()
    print(f"amx_bf16: {'amx_bf16' in cpu_flags()}, threads {torch.get_num_threads()}, AMX_MIN_ROWS {AMX_MIN_ROWS}")
    print(f"{'K x N':>11} {'rows':>5} {'kernel ms':>10} {'torch ms':>9} {'kernel/torch':>13}")
    for k, n in ((576, 1728), (576, 3072), (1536, 576), (576, 49152)):
        w = pack(torch.randn(n, k), "bf16")
        for m in (1, 4, 8, 12, 16, 32, 64, 512):
            x = torch.randn(m, k)
            a = ms(lambda: torch.ops.dmtd.linear(x, w.data, w.scales, w.mode))  # noqa: B023
            b = ms(lambda: F.linear(x.to(torch.bfloat16), w.data).float())  # noqa: B023
            print(f"{k:>5}x{n:<5} {m:>5} {a:>10.3f} {b:>9.3f} {a / b:>13.2f}")


if __name__ == "__main__":
    main()
