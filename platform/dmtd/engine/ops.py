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
# A draft's layers for one sequence's consecutive positions in one call (dmtd.engine.runner; float32 KV written into
# the sequence's pages, table[kv_row]; kc/vc [pages, nkv, page_size, hd]). qkv_b, q_norm, k_norm: float32, empty or
# one a layer (a Qwen2 qkv bias; Qwen3's per-head norms of q and k before rope).
_LIB.define("draft_layers(Tensor h, Tensor[] ln1, Tensor[] qkv_w, Tensor[] qkv_s, Tensor[] o_w, Tensor[] o_s, "
            "Tensor[] ln2, Tensor[] gu_w, Tensor[] gu_s, Tensor[] dn_w, Tensor[] dn_s, Tensor(a!)[] kc, "
            "Tensor(b!)[] vc, Tensor[] qkv_b, Tensor[] q_norm, Tensor[] k_norm, Tensor table, Tensor cos, Tensor sin, "
            "int kv_row, int read_len, int nh, int nkv, int hd, float eps, int mode) -> Tensor")
# Decode rows through a layer group (row r: position pos[r] of sequence kv_rows[r], its pages table[kv_rows[r]]; float32
# KV written) in one call; ``prompt`` [R] flags a prompt's positions (their attention on AMX tiles where the build has
# them: kernels/attend_amx.h).
_LIB.define("rows_layers(Tensor h, Tensor[] ln1, Tensor[] qkv_w, Tensor[] qkv_s, Tensor[] o_w, Tensor[] o_s, "
            "Tensor[] ln2, Tensor[] gu_w, Tensor[] gu_s, Tensor[] dn_w, Tensor[] dn_s, Tensor(a!)[] kc, "
            "Tensor(b!)[] vc, Tensor[] qkv_b, Tensor[] q_norm, Tensor[] k_norm, Tensor table, Tensor cos, Tensor sin, "
            "Tensor kv_rows, Tensor pos, int nh, int nkv, int hd, float eps, int mode, Tensor? prompt=None) -> Tensor")
# Decode rows' attention over the paged float32 KV cache, each row alone (kernels/attend.h): q [B, nh, hd] ->
# [B, nh*hd]; rows flagged in ``prompt`` (runs of one sequence's consecutive positions) on AMX tiles where the build
# has them (kernels/attend_amx.h).
_LIB.define("attend(Tensor q, Tensor kc, Tensor vc, Tensor table, Tensor kv_rows, Tensor lens, float scale, "
            "Tensor? prompt=None) -> Tensor")
# Each row's first argmax and its softmax probability (greedy picks and checks): logits [n, N] -> (idx, p).
_LIB.define("top1(Tensor x) -> (Tensor, Tensor)")
# The AVX2 products' software prefetch distance in bytes (0: none; kernels/lowbit.cpp); returns the one before.
# ``x``: any CPU tensor (it routes the call to the kernels).
_LIB.define("set_prefetch(Tensor x, int bytes) -> int")
# The instruction path the loaded build was compiled for (3 amx, 4 avx512bf16, 2 avx512, 1 avx2, 0 portable; -1 AMX
# refused).
_LIB.define("kernel_path(Tensor x) -> int")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


KERNEL_PATHS: tuple[str, ...] = ("amx", "avx512bf16", "avx512", "avx2", "portable")
"""The kernels' instruction paths, fastest first. Each is row-invariant by itself (a row's bits do not depend on the
rows beside it, their number or the kind of pass); two paths give different bits (``amx`` and ``avx512bf16`` round a
bf16 product's activations to bf16 and multiply bf16 by bf16, the others multiply them in float32)."""


def _amx_permitted() -> bool:
    """Whether Linux lets this process use AMX tiles (it hands out their state on request, from 5.16 on)."""
    try:
        import ctypes

        sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64
        return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


def cpu_paths(flags: set[str] | None = None) -> list[str]:
    """The kernel paths this CPU can run, fastest first (``portable`` always)."""
    flags = cpu_flags() if flags is None else flags
    paths = []
    if {"amx_bf16", "amx_tile", "avx512f", "avx512bw"} <= flags and _amx_permitted():
        paths.append("amx")
    if {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        paths.append("avx512bf16")
    if "avx512f" in flags:
        paths.append("avx512")
    if {"avx2", "fma"} <= flags:
        paths.append("avx2")
    return [*paths, "portable"]


def kernel_path() -> str:
    """The path this process builds and loads: ``DMTD_KERNEL_PATH`` (one of :data:`KERNEL_PATHS`, for tests and
    comparisons; a path the CPU lacks is a ConfigError at load) or the fastest the CPU has."""
    env = os.environ.get("DMTD_KERNEL_PATH", "").strip().lower()
    if env in ("", "auto"):
        return cpu_paths()[0]
    if env not in KERNEL_PATHS:
        raise ValueError(f"DMTD_KERNEL_PATH must be auto or one of {', '.join(KERNEL_PATHS)}, got {env!r}")
    return env


def simd_kernels() -> bool:
    """Whether the kernels run vector code here (any path but ``portable``): AVX-512 or AVX2 with FMA, where the
    kernels are ~4x torch's float32 product on a bf16 lm_head at one row, and 2-3 rows cost about one."""
    try:
        return kernel_path() != "portable"
    except ValueError:
        return False
