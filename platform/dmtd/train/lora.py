"""Native LoRA adapters for our input-major ``Proj`` weights.

Why not ``peft``: peft wraps ``nn.Linear`` modules and patches their ``forward``; our layers are parameter
containers whose computation is the functional :func:`dmtd.engine.model.layer_forward` over gathered weight
tuples (and a TorchScript loop when serving), so a module wrapper would never be called. Instead the
trainer builds each step's effective weights with :func:`dmtd.variants.build.merge_lora` — the same
function the loader uses to merge an adapter once — which makes train/serve parity hold by construction.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dmtd.engine.model import Transformer
from dmtd.variants.build import LORA_A, LORA_B, LORA_FORMAT, merge_lora

LORA_TARGETS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
                "down": "mlp.down_proj"}


class LoRAAdapters(nn.Module):
    """Rank-``rank`` updates ``(alpha / rank) · A @ B`` for the chosen targets of the chosen layers.

    ``A`` starts random and ``B`` at zero, so training starts from the base model exactly.
    """

    def __init__(self, model: Transformer, layers: list[int], targets: list[str], rank: int, alpha: float,
                 seed: int = 0) -> None:
        super().__init__()
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; choose from {sorted(LORA_TARGETS)}")
        self.layers, self.targets, self.rank, self.alpha = list(layers), list(targets), rank, alpha
        self.scale = alpha / rank
        g = torch.Generator().manual_seed(seed)
        sd = model.state_dict()
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for i in layers:
            for t in targets:
                w = sd[self.weight_name(i, t)]
                n_in, n_out = w.shape
                a = torch.randn(n_in, rank, generator=g, dtype=w.dtype) * n_in ** -0.5
                self.a[self._key(i, t)] = nn.Parameter(a.to(w.device))
                self.b[self._key(i, t)] = nn.Parameter(torch.zeros(rank, n_out, dtype=w.dtype, device=w.device))

    @staticmethod
    def weight_name(layer: int, target: str) -> str:
        return f"layers.{layer}.{LORA_TARGETS[target]}.weight"

    @staticmethod
    def _key(layer: int, target: str) -> str:
        return f"{layer}_{target}"

    def merged(self, layer: int, target: str, weight: torch.Tensor) -> torch.Tensor:
        k = self._key(layer, target)
        return merge_lora(weight, self.a[k], self.b[k], self.scale)

    def export(self, path: Path, base_fingerprint: str, dtype: torch.dtype = torch.float32) -> None:
        """Write the ``dmtd-lora-v1`` safetensors file the variant loader merges."""
        pairs = {self.weight_name(i, t): (self.a[self._key(i, t)], self.b[self._key(i, t)])
                 for i in self.layers for t in self.targets}
        save_adapter(path, pairs, self.rank, self.alpha, base_fingerprint, dtype)


def save_adapter(path: Path, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float,
                 base_fingerprint: str, dtype: torch.dtype = torch.float32) -> None:
    """Write ``{weight name: (A, B)}`` as a ``dmtd-lora-v1`` file (merged as ``W + alpha/rank · A @ B``)."""
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[name + LORA_A] = a.detach().to(dtype).contiguous()
        tensors[name + LORA_B] = b.detach().to(dtype).contiguous()
    meta = {"format": LORA_FORMAT, "rank": str(rank), "alpha": str(alpha), "base_fingerprint": base_fingerprint}
    save_file(tensors, str(path), metadata=meta)


@torch.no_grad()
def low_rank_delta(trained: torch.Tensor, base: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` approximation (truncated SVD) of ``trained - base`` as ``(A, B)`` with A @ B ≈ delta."""
    u, s, vh = torch.linalg.svd((trained - base).double(), full_matrices=False)
    r = min(rank, s.numel())
    return (u[:, :r] * s[:r]).to(trained.dtype), vh[:r].to(trained.dtype)


def parse_layers(spec: str, num_layers: int, decoding_start: int) -> list[int]:
    """``decoding`` | ``all`` | ``22-29`` | ``0,5,22-29`` → sorted layer indices."""
    if spec == "decoding":
        return list(range(decoding_start, num_layers))
    if spec == "all":
        return list(range(num_layers))
    out: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        out.update(range(lo, hi + 1))
    if not out or min(out) < 0 or max(out) >= num_layers:
        raise ValueError(f"layers {spec!r} must lie in 0..{num_layers - 1}")
    return sorted(out)
