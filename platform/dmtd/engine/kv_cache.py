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
                 dtype: torch.dtype, device: torch.device | str, hidden_dtype: torch.dtype | None = None) -> None:
        hidden_dtype = hidden_dtype or dtype  # of ``pending`` and ``stash`` (activations; KV may be wider)
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
        self.pending = torch.zeros(num_slots, max(dmtd.tau_max, 1), model.hidden_size, dtype=hidden_dtype,
                                   device=device)
        self.num_slots, self.max_len = num_slots, max_len
        self._spec = (model, dmtd, dtype, device, hidden_dtype)
        self.verify_layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.stash: torch.Tensor | None = None

    def enable_verify(self) -> None:
        """Buffers of verified cycles, made on first use.

        ``verify_layers``: the verifying path's decoding-group KV, beside the tail path's (``layers``), so
        heads attend to verifier keys and values at every position while tails keep their own. ``stash``:
        the tail path's head-routed decoding input at checked positions, consumed by the next draft step.
        """
        if self.verify_layers is not None:
            return
        model, dmtd, dtype, device, hidden_dtype = self._spec
        shape = (self.num_slots, model.num_kv_heads, self.max_len, model.head_dim)
        self.verify_layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(dmtd.num_decoding_layers)
        ]
        self.stash = torch.zeros(self.num_slots, self.max_len, model.hidden_size, dtype=hidden_dtype, device=device)

    @property
    def nbytes(self) -> int:
        bufs = [t for kv in self.layers + (self.verify_layers or []) for t in kv] + [self.pending]
        if self.stash is not None:
            bufs.append(self.stash)
        return sum(t.numel() * t.element_size() for t in bufs)
