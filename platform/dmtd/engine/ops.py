"""Schemas of the engine's own tensor ops (``torch.ops.dmtd.*``); their CPU kernels live in ``kernels/``.

Defined at import so the TorchScript decode loop can call them; a kernel is registered only when
:func:`dmtd.engine.lowbit.load_kernels` has built and loaded it.
"""

from __future__ import annotations

import os

import torch

_LIB = torch.library.Library("dmtd", "DEF")
# y[..., N] = x[..., K] · Wᵀ for a packed weight W (mode 1 bf16, 2 int8 per-group, 3 int4 per-group).
_LIB.define("linear(Tensor x, Tensor w, Tensor s, int mode) -> Tensor")
# A draft's layers for one sequence's consecutive positions in one call (dmtd.engine.runner; float32 KV written).
_LIB.define("draft_layers(Tensor h, Tensor[] ln1, Tensor[] qkv_w, Tensor[] qkv_s, Tensor[] o_w, Tensor[] o_s, "
            "Tensor[] ln2, Tensor[] gu_w, Tensor[] gu_s, Tensor[] dn_w, Tensor[] dn_s, Tensor(a!)[] kc, "
            "Tensor(b!)[] vc, Tensor cos, Tensor sin, int slot, int read_len, int nh, int nkv, int hd, float eps, "
            "int mode) -> Tensor")
# Decode rows through a layer group (row r: position pos[r] of KV slot slots[r]; float32 KV written) in one call.
_LIB.define("rows_layers(Tensor h, Tensor[] ln1, Tensor[] qkv_w, Tensor[] qkv_s, Tensor[] o_w, Tensor[] o_s, "
            "Tensor[] ln2, Tensor[] gu_w, Tensor[] gu_s, Tensor[] dn_w, Tensor[] dn_s, Tensor(a!)[] kc, "
            "Tensor(b!)[] vc, Tensor cos, Tensor sin, Tensor slots, Tensor pos, int nh, int nkv, int hd, float eps, "
            "int mode, int amx_rows) -> Tensor")
# Decode rows' attention over the float32 KV cache, each row alone (kernels/attend.h): q [B, nh, hd] -> [B, nh*hd].
_LIB.define("attend(Tensor q, Tensor kc, Tensor vc, Tensor slots, Tensor lens, float scale) -> Tensor")
# Each row's first argmax and its softmax probability (greedy picks and checks): logits [n, N] -> (idx, p).
_LIB.define("top1(Tensor x) -> (Tensor, Tensor)")
# The AVX2 products' software prefetch distance in bytes (0: none; kernels/lowbit.cpp); returns the one before.
# ``x``: any CPU tensor (it routes the call to the kernels).
_LIB.define("set_prefetch(Tensor x, int bytes) -> int")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def simd_kernels() -> bool:
    """Whether the CPU has the vector units the kernels are written for: AVX-512, or AVX2 with FMA (where the
    kernels are ~4x torch's float32 product on a bf16 lm_head at one row, and 2-3 rows cost about one)."""
    flags = cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def _amx_min_rows() -> int:
    """From how many rows a bf16 product goes to torch's own matmul (oneDNN, which tiles it on AMX) instead of
    the bf16 kernel: 12 on a CPU with AMX-BF16, where torch's matmul measured 1.2x faster at 12 rows, 2.3-2.7x
    at 32 and ~8x at 512 (scripts/bench_amx_rows.py; the kernel streams the weight once per block of rows and
    wins at 1-8 rows); never elsewhere (without AMX, small bf16 products ran slower than float32). Its
    activations and output are rounded to bf16. ``DMTD_AMX_MIN_ROWS`` overrides (0: never)."""
    env = os.environ.get("DMTD_AMX_MIN_ROWS", "").strip()
    if env:
        return int(env) if int(env) > 0 else NEVER
    return 12 if "amx_bf16" in cpu_flags() else NEVER


NEVER = 1 << 62
AMX_MIN_ROWS: int = _amx_min_rows()
