"""``dmtd bench kernels``: the bf16 products of one SmolLM2 layer (qkv, o, gate_up, down) and of its lm_head, by
rows, on every kernel path this CPU has (one process a path, ``DMTD_KERNEL_PATH``), beside torch's own bf16 matmul
(oneDNN: AMX tiles where the CPU has them; not row-invariant — what bf16 products of 12 rows or more ran on an
AMX CPU before the AMX tile kernel). Times are the best of the repeats, in ms, from one run on one machine."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49152 (input K, output N)
LAYER = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)


def add_kernel_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paths", default="all", help="kernel paths to run: all (every one this CPU has) or a list")
    p.add_argument("--rows", default="1,4,16,64,512,2048", help="activation rows per product")
    p.add_argument("--repeats", type=int, default=20, help="timed calls at 64 rows (more below, fewer above)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def _best(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(rows: list[int], repeats: int) -> dict[str, Any]:
    """This process's path: per row count, ms of the layer's four products and of the lm_head (at most 64 rows:
    decoding never projects more), by the kernel and by torch's bf16 matmul."""
    import torch
    import torch.nn.functional as F

    from dmtd.engine import lowbit

    lowbit.load_kernels()
    g = torch.Generator().manual_seed(0)
    layer = [lowbit.pack(torch.randn(n, k, generator=g) * 0.05, "bf16") for k, n in LAYER.values()]
    head = lowbit.pack(torch.randn(LM_HEAD[1], LM_HEAD[0], generator=g) * 0.05, "bf16")
    out: dict[str, Any] = {"path": lowbit.loaded_path(), "threads": torch.get_num_threads(), "rows": {}}
    for r in rows:
        xs = [torch.randn(r, p.in_features, generator=g) for p in layer]
        xh = torch.randn(min(r, 64), LM_HEAD[0], generator=g)
        reps = max(3, int(repeats * 64 / r))  # many short calls: the best of them escapes a busy moment
        out["rows"][r] = {
            "layer_ms": _best(lambda xs=xs: [p.project(x) for p, x in zip(layer, xs)], reps),
            "layer_torch_ms": _best(lambda xs=xs: [F.linear(x.bfloat16(), p.data) for p, x in zip(layer, xs)], reps),
            "lm_head_ms": _best(lambda xh=xh: head.project(xh), reps),
            "lm_head_torch_ms": _best(lambda xh=xh: F.linear(xh.bfloat16(), head.data), reps),
        }
    return out


def run_kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from dmtd.engine.ops import cpu_paths

    paths = cpu_paths() if args.paths == "all" else [p for p in args.paths.split(",") if p]
    rows = [int(r) for r in args.rows.split(",") if r]
    results = {}
    for path in tqdm(paths, desc="bench kernels", unit="path"):
        env = {**os.environ, "DMTD_KERNEL_PATH": path}
        cmd = [sys.executable, "-m", "dmtd.bench.kernel_bench", "--one", ",".join(map(str, rows)), str(args.repeats)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"path {path}: {done.stderr.strip().splitlines()[-1] if done.stderr else 'failed'}")
        results[path] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nms per call, best of {args.repeats}; lm_head at min(rows, 64); torch: F.linear in bf16 (oneDNN)")
    print(f"{'path':>9} {'rows':>5} {'layer':>8} {'torch':>8} {'×torch':>7} {'lm_head':>8} {'torch':>8} {'×torch':>7}")
    for path, res in results.items():
        for r, v in res["rows"].items():
            print(f"{path:>9} {r:>5} {v['layer_ms']:>8.3f} {v['layer_torch_ms']:>8.3f} "
                  f"{v['layer_torch_ms'] / v['layer_ms']:>7.2f} {v['lm_head_ms']:>8.2f} {v['lm_head_torch_ms']:>8.2f} "
                  f"{v['lm_head_torch_ms'] / v['lm_head_ms']:>7.2f}")
    if args.json_path:
        p = Path(args.json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(results, indent=2))
        print(f"wrote {p}")
    return results


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(measure([int(r) for r in sys.argv[2].split(",")], int(sys.argv[3]))))
