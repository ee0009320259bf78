"""Roofline bounds for DMTD decoding: weight bytes against memory bandwidth, FLOPs against matmul throughput.

With refilling every position still passes every layer, so DMTD saves weight reads, not FLOPs: the bound
grows with τ where decoding is memory-bound and stays flat where it is compute-bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dmtd.engine.config import DMTDConfig, ModelConfig, layer_bytes, lm_head_bytes

__all__ = ["layer_bytes", "lm_head_bytes", "bound_tok_s", "measure_rates", "MachineRates"]


@dataclass(slots=True)
class MachineRates:
    """What the bench measured on this machine."""

    copy_gb_s: float  # streaming copy bandwidth (read + write bytes / s)
    matvec_gb_s: float  # weight bytes / s of batch-1 matrix-vector products over a set larger than caches
    matmul_gflop_s: float  # large fp32 matmul throughput
    matmul_bf16_gflop_s: float = 0.0  # large bf16 matmul throughput (torch's oneDNN; 0: not measured)

    def to_dict(self) -> dict[str, float]:
        return {"copy_gb_s": self.copy_gb_s, "matvec_gb_s": self.matvec_gb_s,
                "matmul_gflop_s": self.matmul_gflop_s, "matmul_bf16_gflop_s": self.matmul_bf16_gflop_s}

    def gflop_s(self, precision: str) -> float:
        """The compute ceiling of a precision's products: bf16 at the bf16 matmul's rate where it was measured and
        is faster (a CPU that multiplies bf16 natively), else float32's."""
        return max(self.matmul_gflop_s, self.matmul_bf16_gflop_s) if precision == "bfloat16" else self.matmul_gflop_s


def step_bytes(cfg: ModelConfig, num_layers: int, batch: int, context: int, elem: int = 4) -> float:
    """Bytes one step reads: the weights of ``num_layers`` layers + lm_head, plus those layers' KV cache."""
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * context * elem * batch
    return num_layers * (layer_bytes(cfg, elem) + kv) + lm_head_bytes(cfg, elem)


def token_flops(cfg: ModelConfig, context: int) -> float:
    """FLOPs to produce one token (every position passes every layer once, refilled or not)."""
    per_layer = 2 * layer_bytes(cfg, 1) + 4 * cfg.num_heads * cfg.head_dim * context
    return cfg.num_layers * per_layer + 2 * cfg.vocab_size * cfg.hidden_size


def bound_tok_s(cfg: ModelConfig, dmtd: DMTDConfig | None, tau: int, batch: int, context: int,
                rates: MachineRates) -> dict[str, float]:
    """Upper bound on decode tokens/s for a batch whose rows share their phase (one cycle = τ steps)."""
    full = step_bytes(cfg, cfg.num_layers, batch, context)
    if tau == 1 or dmtd is None:
        cycle_bytes = full
    else:
        tail_layers = dmtd.num_encoding_layers + dmtd.num_decoding_layers
        cycle_bytes = full + (tau - 1) * step_bytes(cfg, tail_layers, batch, context)
    tokens = batch * max(tau, 1)
    t_mem = cycle_bytes / (rates.matvec_gb_s * 1e9)
    t_flop = tokens * token_flops(cfg, context) / (rates.matmul_gflop_s * 1e9)
    return {"bound_tok_s": tokens / max(t_mem, t_flop), "mem_bound_tok_s": tokens / t_mem,
            "flop_bound_tok_s": tokens / t_flop, "bytes_per_token": cycle_bytes / tokens,
            "limited_by": 0.0 if t_mem >= t_flop else 1.0}


def _best(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t)
    return best


def _matvec_gb_s(working_set_mb: int, repeats: int) -> float:
    mats = [torch.randn(576, 3072) for _ in range(max(1, working_set_mb // 7))]
    x = torch.randn(1, 576)
    t = _best(lambda: [torch.matmul(x, w) for w in mats], repeats)
    return sum(w.numel() * 4 for w in mats) / t / 1e9


def _matmul_gflop_s(repeats: int, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(1024, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    return 2 * 1024 * 2048 * 2048 / _best(lambda: torch.matmul(a, b), repeats) / 1e9


def _copy_gb_s(working_set_mb: int, repeats: int) -> float:
    n = working_set_mb * (1 << 20) // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    return 2 * n * 4 / _best(lambda: dst.copy_(src), repeats) / 1e9


@torch.inference_mode()
def measure_rates(working_set_mb: int = 768, repeats: int = 3) -> MachineRates:
    """Measure batch-1 matvec bandwidth (over a set larger than the caches), matmul throughput, copy bandwidth.

    The matvec runs first: a large copy beforehand leaves the allocator's fresh pages slow to stream.
    """
    return MachineRates(matvec_gb_s=_matvec_gb_s(working_set_mb, repeats), matmul_gflop_s=_matmul_gflop_s(repeats + 2),
                        copy_gb_s=_copy_gb_s(working_set_mb, repeats),
                        matmul_bf16_gflop_s=_matmul_gflop_s(repeats + 2, torch.bfloat16))
