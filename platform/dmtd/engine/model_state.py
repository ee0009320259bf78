"""What every pass of the runner reads: the model, the engine's copies of its weights, the KV cache and the verifying
path's; the step contexts over them and the logits. :class:`dmtd.engine.runner.ModelRunner` builds it and hands it to
its pass runners (:mod:`dmtd.engine.prefill`, :mod:`dmtd.engine.verified_passes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dmtd.engine import lowbit
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.kv_cache import KVCache
from dmtd.engine.model import LayerWeights, StepContext, Transformer, project
from dmtd.engine.verifier import Verifier


@dataclass(eq=False, kw_only=True)
class ModelState:
    """The model as the engine runs it. ``verify_kv`` is None until the first exact request (:meth:`enable_verify`).
    (Not slotted: a test may wrap :meth:`logits` on the instance to see every pass's logits.)"""

    model: Transformer
    dmtd: DMTDConfig
    cfg: EngineConfig
    device: torch.device
    act_dtype: torch.dtype  # the activations' (residual stream, pending tails, stashes)
    weights: list[LayerWeights]  # the engine's layers, packed where the weight format says
    head: torch.Tensor | lowbit.PackedWeight  # lm_head [H, V], likewise
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # a layer's KV, page pool views
    cache: KVCache
    verifier: Verifier
    verify_weights: list[LayerWeights]  # the verifying path's: the shared groups', then the verifier's decoding group
    verify_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # other variants of the same trunk (dmtd.engine.tails): each one's layers, the engine's own up to the decoding
    # group and then its decoding group, in the engine's format; one list object a variant (the rows op's arguments
    # are gathered once per list)
    tails: dict[str, list[LayerWeights]] = field(default_factory=dict)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return project(self.model.norm.forward(h), self.head)

    def enable_verify(self) -> bool:
        """The verifying path's KV (allocated at the first exact request); True if this call allocated it."""
        if self.verify_kv is not None:
            return False
        self.cache.enable_verify()
        assert self.cache.verify_layers is not None
        self.verify_kv = self.kv[: self.dmtd.decoding_start] + self.cache.verify_layers
        return True

    def right_aligned(self, last: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions [n, R] of ``counts[i]`` positions ending at ``last[i]``, right-aligned; valid mask."""
        dev = self.device
        R = max(counts)
        offs = torch.arange(R - 1, -1, -1, device=dev)
        pos = (torch.tensor(last, device=dev)[:, None] - offs[None, :]).clamp(min=0)
        if all(c == R for c in counts):
            return pos, None
        return pos, offs[None, :] < torch.tensor(counts, device=dev)[:, None]

    def context(self, kv_rows: list[int], positions: torch.Tensor, valid: torch.Tensor | None) -> StepContext:
        """Context for cache rows ``kv_rows`` at ``positions`` [B, S] (valid [B, S] marks real, non-padding
        entries)."""
        self.cache.sync()
        B, S = positions.shape
        dev = self.device
        kv_row_t = torch.tensor(kv_rows, dtype=torch.long, device=dev)
        read_len = int(positions.max()) + 1
        mask = None  # a single sequence at a single position attends to every key up to read_len
        if B > 1 or S > 1:
            keys = torch.arange(read_len, device=dev)
            mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        cos, sin = self.model.rope(positions)
        if valid is None:
            write_kv_rows, write_pos, rows = kv_row_t.repeat_interleave(S), positions.reshape(-1), None
        else:
            rows = valid.reshape(-1).nonzero().squeeze(1)
            write_kv_rows = kv_row_t.repeat_interleave(S)[rows]
            write_pos = positions.reshape(-1)[rows]
        if cos.dtype != self.act_dtype:
            cos, sin = cos.to(self.act_dtype), sin.to(self.act_dtype)
        return StepContext(cos=cos, sin=sin, attn_mask=mask, read_len=read_len, kv_rows=kv_row_t,
                           table=self.cache.table, write_kv_rows=write_kv_rows, write_pos=write_pos, write_rows=rows)

    def rows_context(self, kv_rows: torch.Tensor, pos: torch.Tensor, prompt: torch.Tensor) -> StepContext:
        """The context of rows for ``dmtd::rows_layers``: row r is position ``pos[r]`` of cache row ``kv_rows[r]``,
        ``prompt[r]`` whether it is a prompt's position."""
        none = torch.empty(0, device=self.device)
        return StepContext(cos=none, sin=none, attn_mask=None, read_len=int(pos.max()) + 1, kv_rows=kv_rows[:0],
                           table=self.cache.table, write_kv_rows=kv_rows, write_pos=pos, write_rows=None,
                           prompt_rows=prompt)

    def weights_of(self, variant: str) -> list[LayerWeights]:
        """The layers a sequence of ``variant`` runs its tail path on (``""``: the engine's own)."""
        return self.weights if not variant else self.tails[variant]

    def by_variant(self, variants: list[str], weights_of: Callable[[str], list[LayerWeights]] | None = None,
                   ) -> list[tuple[list[LayerWeights], list[int] | None]]:
        """Rows grouped by whose tails they run: (the group's layers, its rows' indices); a single group (indices
        None: every row) where they all run the same."""
        of = weights_of or self.weights_of
        first = variants[0] if variants else ""
        if all(v == first for v in variants):
            return [(of(first), None)]
        rows: dict[str, list[int]] = {}
        for i, v in enumerate(variants):
            rows.setdefault(v, []).append(i)
        return [(of(v), idx) for v, idx in rows.items()]

    def decoding_rows(self, x: torch.Tensor, variants: list[str],
                      ctx_of: Callable[[torch.Tensor | slice], StepContext]) -> torch.Tensor:
        """The tail path's decoding group over rows ``x`` [1, n, H] (``dmtd::rows_layers``), each row on its
        variant's layers (``variants[r]``); ``ctx_of(keep)``: the context of the rows ``keep``."""
        m, d = self.model, self.dmtd
        groups = self.by_variant(variants)
        if len(groups) == 1:
            return m.run_rows(x, d.decoding_start, d.num_layers, self.kv, ctx_of(slice(None)), groups[0][0])
        h = x.new_empty(x.shape)
        for w, idx in groups:
            assert idx is not None  # (several groups: each names its rows)
            keep = torch.tensor(idx, device=self.device)
            h[:, keep] = m.run_rows(x[:, keep], d.decoding_start, d.num_layers, self.kv, ctx_of(keep), w)
        return h

    def decoding_batch(self, x: torch.Tensor, variants: list[str], kv_rows: list[int], positions: torch.Tensor,
                       valid: torch.Tensor | None, ctx: StepContext,
                       weights_of: Callable[[str], list[LayerWeights]] | None = None) -> torch.Tensor:
        """The tail path's decoding group over ``x`` [B, S, H] (sequence ``b`` of cache row ``kv_rows[b]`` at
        ``positions[b]``, ``ctx`` their context), each sequence on its variant's layers (``weights_of``, else the
        engine's): one call a variant, every row computed alone as in a batch of its own."""
        m, d = self.model, self.dmtd
        groups = self.by_variant(variants, weights_of)
        if len(groups) == 1:
            return m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.kv, ctx, groups[0][0])
        h = torch.empty_like(x)
        for w, idx in groups:
            assert idx is not None
            rows = torch.tensor(idx, device=self.device)
            sub = self.context([kv_rows[i] for i in idx], positions[rows], None if valid is None else valid[rows])
            h[rows] = m.run_layers(x[rows], d.decoding_start, d.num_layers, sub.cos, sub.sin, self.kv, sub, w)
        return h
