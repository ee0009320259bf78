"""Runs scheduled batches through the model: prefill, and decode steps mixing heads and tails."""

from __future__ import annotations

import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.kv_cache import KVCache
from dmtd.engine.model import StepContext, Transformer, route_decoding_input
from dmtd.engine.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def _slot_range(slots: list[int]) -> tuple[int, int] | None:
    a = slots[0]
    return (a, a + len(slots)) if slots == list(range(a, a + len(slots))) else None


class ModelRunner:
    """Owns the model and its KV cache; turns a batch of sequences into next-token logits.

    A decode step runs, for every row, the encoding group and the decoding group at the row's
    position. Rows at a head also run the thinking group over their pending tail positions plus the
    head, in one causal pass (cyclical refilling), before their decoding group.
    """

    def __init__(self, model: Transformer, dmtd: DMTDConfig, cfg: EngineConfig) -> None:
        dmtd.check_model(model.config)
        self.model, self.dmtd, self.cfg = model.prepare_inference(), dmtd, cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.cache = KVCache(model.config, dmtd, cfg.max_num_seqs, cfg.max_model_len, self.dtype, self.device)
        self.kv = self.cache.layers

    def _context(self, slots: list[int], positions: torch.Tensor, valid: torch.Tensor | None) -> StepContext:
        """Context for rows at ``positions`` [B, S] (valid [B, S] marks real, non-padding entries)."""
        B, S = positions.shape
        dev = self.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        read_len = int(positions.max()) + 1
        mask = None  # a single row at a single position attends to every key up to read_len
        if B > 1 or S > 1:
            keys = torch.arange(read_len, device=dev)
            mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        cos, sin = self.model.rope(positions)
        if valid is None:
            write_slots, write_pos, rows = slot_t.repeat_interleave(S), positions.reshape(-1), None
        else:
            rows = valid.reshape(-1).nonzero().squeeze(1)
            write_slots = slot_t.repeat_interleave(S)[rows]
            write_pos = positions.reshape(-1)[rows]
        one = (slots[0], int(positions[0, 0])) if B == 1 and S == 1 else None
        if cos.dtype != self.dtype:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        return StepContext(cos, sin, mask, read_len, slot_t, _slot_range(slots), write_slots, write_pos, rows,
                           one)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run whole prompts through every layer; logits of each prompt's last position [n, V]."""
        m, d = self.model, self.dmtd
        lens = [s.num_tokens for s in seqs]
        T = max(lens)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.tensor(s.token_ids)
        ids = ids.to(self.device)
        pos = torch.arange(T, device=self.device).expand(len(seqs), T)
        lens_t = torch.tensor(lens, device=self.device)
        valid = pos < lens_t[:, None]
        ctx = self._context([s.slot for s in seqs], pos, None if all(n == T for n in lens) else valid)
        h_enc = m.run_layers(m.embed_tokens(ids).to(self.dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             self.kv, ctx)
        h_think = m.run_layers(h_enc, d.thinking_start, d.decoding_start, ctx.cos, ctx.sin, self.kv, ctx)
        if d.phase_anchor == "absolute":
            head = pos % torch.tensor([s.cycle_len for s in seqs], device=self.device)[:, None] == 0
        else:
            head = torch.ones_like(valid)
        x = route_decoding_input(h_enc, h_think, head, d.head_input)
        last = (lens_t - 1)[:, None, None].expand(-1, 1, x.shape[-1])
        # The decoding group must still write KV for every prompt position; logits only for the last.
        h = m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.kv, ctx)
        return m.logits(h.gather(1, last)[:, 0])

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One position per row; heads refill and run the thinking group. Logits [B, V]."""
        m, d, dev = self.model, self.dmtd, self.device
        slots = [s.slot for s in seqs]
        pos = torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=dev)
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=dev)
        ctx = self._context(slots, pos, None)
        h_enc = m.run_layers(m.embed_tokens(ids).to(self.dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             self.kv, ctx)
        heads = [i for i, s in enumerate(seqs) if s.next_is_head]
        tails = [i for i, s in enumerate(seqs) if not s.next_is_head]
        x = h_enc
        if tails:
            t_slots = torch.tensor([slots[i] for i in tails], device=dev)
            t_idx = torch.tensor([seqs[i].num_pending for i in tails], device=dev)
            self.cache.pending[t_slots, t_idx] = h_enc[torch.tensor(tails, device=dev), 0]
        if heads:
            h_think = self._refill([seqs[i] for i in heads], h_enc[heads])
            x = h_enc.clone()
            head_rows = torch.tensor(heads, device=dev)
            x[head_rows] = h_think + h_enc[head_rows] if d.head_input == "residual_add" else h_think
        h = m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.kv, ctx)
        return m.logits(h[:, 0])

    def _refill(self, seqs: list[Sequence], h_head: torch.Tensor) -> torch.Tensor:
        """Thinking group over each head row's pending tails + the head, right-aligned. → [n, 1, H]."""
        dev = self.device
        n_new = [s.num_pending + 1 for s in seqs]
        R = max(n_new)
        if R == 1:
            inp = h_head
            pos = torch.tensor([[s.position] for s in seqs], device=dev)
            valid = None
        else:
            inp = torch.zeros(len(seqs), R, h_head.shape[-1], dtype=self.dtype, device=dev)
            inp[:, -1] = h_head[:, 0]
            for i, s in enumerate(seqs):
                if n_new[i] > 1:
                    inp[i, R - n_new[i]: R - 1] = self.cache.pending[s.slot, : n_new[i] - 1]
            last = torch.tensor([s.position for s in seqs], device=dev)
            offs = torch.arange(R - 1, -1, -1, device=dev)
            raw = last[:, None] - offs[None, :]
            valid = offs[None, :] < torch.tensor(n_new, device=dev)[:, None]
            pos = raw.clamp(min=0)
        ctx = self._context([s.slot for s in seqs], pos, valid)
        out = self.model.run_layers(inp, self.dmtd.thinking_start, self.dmtd.decoding_start, ctx.cos, ctx.sin,
                                    self.kv, ctx)
        return out[:, -1:]
