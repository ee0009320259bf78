"""Preallocated KV cache, per layer group, one row (slot) per running sequence."""

from __future__ import annotations

import torch

from dmtd.engine.config import DMTDConfig, ModelConfig


class KVCache:
    """Fixed-shape buffers ``[num_slots, num_kv_heads, max_len, head_dim]`` for every layer.

    Layers are grouped as the variant splits them (encoding / thinking / decoding); the groups fill at
    different speeds — the thinking group lags the others by the tails that await refill — so their
    lengths are tracked per sequence by the scheduler. ``pending`` holds the encoding-group output of
    those tail positions (the thinking group's input at the next head).
    """

    def __init__(self, model: ModelConfig, dmtd: DMTDConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_slots, model.num_kv_heads, max_len, model.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]
        self.groups = {
            "encoding": range(0, dmtd.thinking_start),
            "thinking": range(dmtd.thinking_start, dmtd.decoding_start),
            "decoding": range(dmtd.decoding_start, dmtd.num_layers),
        }
        self.pending = torch.zeros(num_slots, max(dmtd.tau_max, 1), model.hidden_size, dtype=dtype,
                                   device=device)
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers) + (
            self.pending.numel() * self.pending.element_size()
        )
