"""``dmtd bench kernels``: the bf16 products of one decoder layer (qkv, o, gate_up, down) and of its lm_head, by rows,
on every kernel path this CPU has (one process a path, ``DMTD_KERNEL_PATH``), beside torch's own bf16 matmul (oneDNN:
AMX tiles or AVX512-BF16 where the CPU has them; not row-invariant) and against the CPU's measured roofline: GFLOP/s
of a large bf16 matmul (the compute peak) and GB/s of a streaming read (what one row's products, which read each
weight once, can reach). Times are the best of the repeats, in ms, from one run on one machine."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (input K, output N) of a layer's four products and the lm_head, per shape: SmolLM2-135M (hidden 576, 9 query and 3
# KV heads of 64, MLP 1536, vocabulary 49152) and Qwen3-1.7B (hidden 2048, 16 query and 8 KV heads of 128, MLP 6144,
# vocabulary 151936)
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "smollm2-135m": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                     "lm_head": (576, 49152)},
    "qwen3-1.7b": {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048),
                   "lm_head": (2048, 151936)},
}
LM_HEAD_ROWS = 64  # decoding never projects more rows through the lm_head


def add_kernel_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paths", default="all", help="kernel paths to run: all (every one this CPU has) or a list")
    p.add_argument("--rows", default="1,4,16,64,512,2048", help="activation rows per product")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="the layer and lm_head shapes")
    p.add_argument("--repeats", type=int, default=20, help="timed calls at 64 rows (more below, fewer above)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PNG", help="GFLOP/s by rows against the roofline (default: next "
                   "to --json)")


def _best(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def roofline(repeats: int = 5) -> dict[str, float]:
    """The CPU's measured ceilings on all threads: GFLOP/s of a 2048³ bf16 matmul (torch, oneDNN) and GB/s of a
    streaming read of 1 GiB (a sum: every byte loaded once)."""
    import torch

    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    peak = 2 * 2048**3 / (_best(lambda: torch.matmul(a, b), repeats) / 1e3) / 1e9
    big = torch.ones(1 << 29, dtype=torch.bfloat16)
    stream = big.numel() * 2 / (_best(lambda: big.sum(), repeats) / 1e3) / 1e9
    return {"peak_gflop_s": peak, "stream_gb_s": stream}


def measure(rows: list[int], repeats: int, shape: str) -> dict[str, Any]:
    """This process's path: per row count, ms of the layer's four products and of the lm_head (at most
    LM_HEAD_ROWS rows), by the kernel and by torch's bf16 matmul."""
    import torch
    import torch.nn.functional as F

    from dmtd.engine import lowbit

    lowbit.load_kernels()
    dims = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    layer = [lowbit.pack(torch.randn(n, k, generator=g) * 0.05, "bf16") for name, (k, n) in dims.items()
             if name != "lm_head"]
    k_h, n_h = dims["lm_head"]
    head = lowbit.pack(torch.randn(n_h, k_h, generator=g) * 0.05, "bf16")
    # torch multiplies the same bf16 weights, dense [N, K] (a path's packed layout may be blocked)
    layer_dense = [lowbit.unpack(p).bfloat16() for p in layer]
    head_dense = lowbit.unpack(head).bfloat16()
    out: dict[str, Any] = {"path": lowbit.loaded_path(), "threads": torch.get_num_threads(), "shape": shape,
                           "rows": {}}
    for r in rows:
        xs = [torch.randn(r, p.in_features, generator=g) for p in layer]
        xh = torch.randn(min(r, LM_HEAD_ROWS), k_h, generator=g)
        reps = max(3, int(repeats * 64 / r))  # many short calls: the best of them escapes a busy moment
        out["rows"][r] = {
            "layer_ms": _best(lambda xs=xs: [p.project(x) for p, x in zip(layer, xs)], reps),
            "layer_torch_ms": _best(lambda xs=xs: [F.linear(x.bfloat16(), d) for d, x in zip(layer_dense, xs)], reps),
            "lm_head_ms": _best(lambda xh=xh: head.project(xh), reps),
            "lm_head_torch_ms": _best(lambda xh=xh: F.linear(xh.bfloat16(), head_dense), reps),
        }
    return out


def rates(shape: str, rows: int, ms: float, lm_head: bool) -> tuple[float, float]:
    """GFLOP/s and weight GB/s of a call that took ``ms``."""
    dims = SHAPES[shape]
    prods = [dims["lm_head"]] if lm_head else [v for k, v in dims.items() if k != "lm_head"]
    m = min(rows, LM_HEAD_ROWS) if lm_head else rows
    flops = sum(2 * m * k * n for k, n in prods)
    return flops / ms / 1e6, sum(2 * k * n for k, n in prods) / ms / 1e6


def run_kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from dmtd.engine.ops import cpu_paths

    paths = cpu_paths() if args.paths == "all" else [p for p in args.paths.split(",") if p]
    rows = [int(r) for r in args.rows.split(",") if r]
    results: dict[str, Any] = {}
    for path in tqdm(paths, desc="bench kernels", unit="path"):
        env = {**os.environ, "DMTD_KERNEL_PATH": path}
        cmd = [sys.executable, "-m", "dmtd.bench.kernel_bench", "--one", ",".join(map(str, rows)), str(args.repeats),
               args.shape]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"path {path}: {done.stderr.strip().splitlines()[-1] if done.stderr else 'failed'}")
        results[path] = json.loads(done.stdout.strip().splitlines()[-1])
    roof = roofline()
    # a ceiling a kernel beats was not the CPU's (caches larger than the probe's working set, a matmul below peak):
    # the roofline is the best of the probes and of every product measured
    for res in results.values():
        for r, v in res["rows"].items():
            for ms, head in ((v["layer_ms"], False), (v["lm_head_ms"], True), (v["layer_torch_ms"], False),
                             (v["lm_head_torch_ms"], True)):
                gf, gb = rates(args.shape, int(r), ms, head)
                roof["peak_gflop_s"] = max(roof["peak_gflop_s"], gf if int(r) >= 16 else 0.0)
                roof["stream_gb_s"] = max(roof["stream_gb_s"], gb if int(r) == 1 else 0.0)
    print(f"\n{args.shape}: ms per call, best of {args.repeats}; lm_head at min(rows, {LM_HEAD_ROWS}); torch: F.linear "
          f"in bf16 (oneDNN). Roofline: {roof['peak_gflop_s']:.0f} GFLOP/s, {roof['stream_gb_s']:.1f} GB/s (the best "
          f"of a bf16 2048³ matmul, a streaming read and every product here)")
    print(f"{'path':>10} {'rows':>5} {'layer':>8} {'torch':>8} {'×torch':>7} {'GFLOP/s':>8} {'GB/s':>6} {'of roof':>7}"
          f" {'lm_head':>8} {'torch':>8} {'×torch':>7} {'of roof':>7}")
    for path, res in results.items():
        for r, v in res["rows"].items():
            gf, gb = rates(args.shape, int(r), v["layer_ms"], False)
            hgf, hgb = rates(args.shape, int(r), v["lm_head_ms"], True)
            # a product is bound by bytes or by FLOPs: its share of the nearer ceiling
            roofs = [min(1.0, max(gb / roof["stream_gb_s"], f / roof["peak_gflop_s"])) for f, gb in ((gf, gb),
                                                                                                  (hgf, hgb))]
            v.update(layer_gflop_s=gf, layer_gb_s=gb, lm_head_gflop_s=hgf, lm_head_gb_s=hgb, layer_of_roof=roofs[0],
                     lm_head_of_roof=roofs[1],
                     layer_torch_gflop_s=rates(args.shape, int(r), v["layer_torch_ms"], False)[0])
            head_x = v["lm_head_torch_ms"] / v["lm_head_ms"]
            print(f"{path:>10} {r:>5} {v['layer_ms']:>8.3f} {v['layer_torch_ms']:>8.3f} "
                  f"{v['layer_torch_ms'] / v['layer_ms']:>7.2f} {gf:>8.0f} {gb:>6.1f} {100 * roofs[0]:>6.0f}% "
                  f"{v['lm_head_ms']:>8.2f} {v['lm_head_torch_ms']:>8.2f} {head_x:>7.2f} {100 * roofs[1]:>6.0f}%")
    out = {"shape": args.shape, "roofline": roof, "paths": results}
    if args.json_path:
        p = Path(args.json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out, indent=2))
        print(f"wrote {p}")
    plot = args.plot or (str(Path(args.json_path).with_suffix(".png")) if args.json_path else None)
    if plot:
        _plot(out, plot)
        print(f"wrote {plot}")
    return out


def _plot(out: dict[str, Any], path: str) -> None:
    """GFLOP/s of the layer's products by rows, per path and torch, under the roofline (bytes at few rows, the
    compute peak at many)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof, shape = out["roofline"], out["shape"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    torch_drawn = False
    for kernel_path, res in out["paths"].items():
        rs = [int(r) for r in res["rows"]]
        ax.plot(rs, [v["layer_gflop_s"] for v in res["rows"].values()], "o-", label=f"dmtd {kernel_path}")
        if not torch_drawn:
            ax.plot(rs, [v["layer_torch_gflop_s"] for v in res["rows"].values()], "k--", label="torch bf16 (oneDNN)")
            torch_drawn = True
        xs = sorted(rs)
    dims = SHAPES[shape]
    wbytes = sum(2 * k * n for name, (k, n) in dims.items() if name != "lm_head")
    flop_per_row = wbytes  # 2·K·N FLOPs a row per 2·K·N bytes of bf16 weights
    ax.plot(xs, [min(roof["peak_gflop_s"], roof["stream_gb_s"] * r * flop_per_row / wbytes) for r in xs], "r:",
            label=f"roofline ({roof['peak_gflop_s']:.0f} GFLOP/s, {roof['stream_gb_s']:.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("activation rows")
    ax.set_ylabel("GFLOP/s, one layer's products")
    ax.set_title(f"bf16 products, {shape}, {out['paths'][next(iter(out['paths']))]['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(measure([int(r) for r in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4])))
