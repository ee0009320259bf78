"""Runs scheduled batches through the model: prefill, and decode steps mixing heads and tails."""

from __future__ import annotations

import math
import os

import torch

from dmtd.engine import lowbit
from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.kv_cache import KVCache, bytes_per_position
from dmtd.engine.kv_pages import KVPages, pages_for
from dmtd.engine.model import LayerWeights, StepContext, Transformer, project, route_decoding_input
from dmtd.engine.prefill import Prefill
from dmtd.engine.sequence import Sequence
from dmtd.engine.verified_passes import VerifiedPasses
from dmtd.engine.verifier import Verifier, own_verifier

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


class ModelRunner(Prefill, VerifiedPasses):
    """Owns the model and its KV cache; turns a batch of sequences into next-token logits.

    A decode step runs, for every row, the encoding group and the decoding group at the row's
    position. Rows at a head also run the thinking group over their pending tail positions plus the
    head, in one causal pass (cyclical refilling), before their decoding group.

    Verified cycles (requests with ``exact``) use :meth:`draft` for their tails and :meth:`verify` for
    their heads, with the verifier's decoding-group weights and KV beside the tail path's.
    """

    def __init__(self, model: Transformer, dmtd: DMTDConfig, cfg: EngineConfig,
                 verifier: Verifier | None = None) -> None:
        dmtd.check_model(model.config)
        self.model, self.dmtd, self.cfg = model.prepare_inference(), dmtd, cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        # bf16 keeps its KV cache (and so attention) in float32: attention then computes a row the same way
        # whatever else shares its step, which the exact profile's equality with τ = 1 rests on
        self.kv_dtype = torch.float32 if self.dtype == torch.bfloat16 else self.dtype
        self.verifier = verifier or own_verifier(dmtd, is_base=dmtd.head_input == "replace")
        have = next(model.parameters()).dtype
        if have != self.dtype:
            raise ConfigError(f"dtype is {cfg.dtype} but the model's weights are {str(have).removeprefix('torch.')}: "
                              "load the model in the engine's dtype")
        self.weight_format = lowbit.weight_format(cfg.dtype, cfg.quant, self.device.type)
        # decode rows attend through dmtd::attend where the kernels build: one call a layer, each row alone
        # (DMTD_ATTEND=0: torch's ops instead, to compare)
        self.model.attend_kernel = (self.device.type == "cpu" and self.kv_dtype == torch.float32
                                    and os.environ.get("DMTD_ATTEND", "1") != "0" and lowbit.kernels_available())
        # decode rows of packed weights run a layer group in one call (dmtd::rows_layers, float32 throughout) where
        # the kernels build (DMTD_FUSED_LAYERS=0: the TorchScript loop instead, to compare)
        self.model.fused_layers = self.model.attend_kernel and os.environ.get("DMTD_FUSED_LAYERS", "1") != "0"
        self.weights, self.head = self._pack(self.weight_format)
        # Activations (the residual stream, pending tails, stashes) stay float32 on packed half-precision weights:
        # rounded to bf16 they were rounded wherever a layer group ends, and two engines that split the same layers
        # into different groups (a variant's verifier, the base model) gave a position different bits
        packed = self.weights is not self.model.layer_weights()
        self.act_dtype = torch.float32 if packed and self.dtype in (torch.bfloat16, torch.float16) else self.dtype
        self.cache = KVCache(model.config, dmtd, cfg.max_num_seqs, cfg.max_model_len, self._page_pool(model),
                             self.kv_dtype, self.device, self.act_dtype)
        self.kv = self.cache.layers
        vl = self.verifier.layers
        self.verify_weights = self.weights if vl is None else (
            self.weights[: dmtd.decoding_start] + self._pack_layers(vl, self.weight_format))
        self.verify_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.draft_ids: torch.Tensor | None = None  # restricted tail vocabulary (None = the full one)
        self._draft_id_set: set[int] | None = None
        self.pass_draft_ids: torch.Tensor | None = None  # the last draft pass's: draft_ids + its rows' context ids
        self.prompt_logits = torch.empty(0)  # the last check pass's riding prompts' logits (verify)
        self.deferred = []  # exact prompts' rows awaiting the variant's decoding group (Prefill.catch_up)
        # the context ids last added (sorted), draft_ids + them, and their head columns [H, E]: rebuilt only when
        # the ids change (a request's context gains a new word every few cycles, not every pass)
        self._context_head: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None
        self._draft_head: torch.Tensor | lowbit.PackedWeight | None = None
        self._tail_head: torch.Tensor | lowbit.PackedWeight | None = None  # the head's draft-vocabulary columns
        # drafts' weights: the tail path's encoding and decoding groups, packed for speed only (the verifier
        # checks every draft, so their precision changes acceptance, never the output); set by enable_exact
        self.draft_format = lowbit.draft_format(cfg.draft_quant, self.device.type)
        self.draft_weights = self.weights
        # dmtd::draft_layers' per-layer arguments gathered by column, per layer group (start, end): one sequence
        self._fused: dict[tuple[int, int], tuple[int, list[list[torch.Tensor]]]] | None = None

    def _page_pool(self, model: Transformer) -> KVPages:
        """The KV pool's pages: ``kv_cache_gib`` of memory, else ``kv_cache_tokens`` positions, else room for every
        sequence at ``max_model_len``. With prefix caching a prefill chunk is whole pages: the page size is then the
        largest divisor of ``prefill_chunk`` not above ``page_size``."""
        cfg, P = self.cfg, self.cfg.page_size
        if cfg.prefix_caching:
            P = math.gcd(P, cfg.prefill_chunk)
        if cfg.kv_cache_gib is not None:
            per = bytes_per_position(model.config, self.dmtd, self.kv_dtype, self.act_dtype)
            num_pages = int(cfg.kv_cache_gib * 2**30) // (per * P)
            if num_pages < 1:
                raise ConfigError(f"kv_cache_gib {cfg.kv_cache_gib} holds no page of {P} positions "
                                  f"({per * P} bytes)")
        elif cfg.kv_cache_tokens is not None:
            num_pages = cfg.kv_cache_tokens // P
        else:
            num_pages = cfg.max_num_seqs * pages_for(cfg.max_model_len, P)
        return KVPages(num_pages, P, cfg.max_num_seqs)

    def _pack_layers(self, layers: list[LayerWeights], fmt: str | None) -> list[LayerWeights]:
        if fmt is None:
            return layers
        if fmt == "bf16" and any(w.shape[0] % lowbit.GROUP for lw in layers for w in (lw.qkv, lw.down)):
            return layers  # the automatic bf16 kernel does not fit this model's shapes: torch's own matmuls
        return lowbit.pack_layers(layers, fmt)

    def _pack(self, fmt: str | None) -> tuple[list[LayerWeights], torch.Tensor | lowbit.PackedWeight]:
        """The engine's copies of the layer weights and lm_head ``[H, V]``, packed when ``fmt`` says so."""
        m = self.model
        layers = self._pack_layers(m.layer_weights(), fmt)
        dense = m.lm_head.weight if m.lm_head is not None else m.lm_head_t
        assert dense is not None
        if fmt is None or layers is m.layer_weights():
            return layers, dense.detach()
        return layers, lowbit.pack(dense.detach().t(), fmt)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return project(self.model.norm.forward(h), self.head)

    def enable_exact(self) -> None:
        """Allocate the verifying path's KV (first use of verified cycles)."""
        if self.verify_kv is None:
            self.cache.enable_verify()
            assert self.cache.verify_layers is not None
            self.verify_kv = self.kv[: self.dmtd.decoding_start] + self.cache.verify_layers
            dense, d, fmt = self.model.layer_weights(), self.dmtd, self.draft_format
            if fmt is not None and lowbit.fits(dense, fmt):
                self.draft_weights = (lowbit.pack_layers(dense[: d.thinking_start], fmt)
                                      + self.weights[d.thinking_start: d.decoding_start]
                                      + lowbit.pack_layers(dense[d.decoding_start:], fmt))
                self._draft_head = None
                groups = [(0, d.thinking_start), (d.decoding_start, d.num_layers)]
                fused = {g: self.model.rows_args(self.draft_weights, self.kv, *g) for g in groups if g[0] < g[1]}
                self._fused = None if None in fused.values() else fused  # type: ignore[assignment]
            else:
                self.draft_format = None

    def draft_bytes_share(self) -> float:
        """Weight bytes a draft pass reads (the tail path's layers in the drafts' format, the draft head) ÷ those a
        plain step reads (every layer, the whole lm_head): what a tail costs where weight reads set the pace."""
        d = self.dmtd
        tail = self.draft_weights[: d.thinking_start] + self.draft_weights[d.decoding_start:]
        return ((_layer_bytes(tail) + _weight_bytes(self.draft_head()))
                / (_layer_bytes(self.weights) + _weight_bytes(self.head)))

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Drafts score only ``ids`` (FR-Spec); verification keeps the full vocabulary."""
        self.draft_ids, self._draft_head = (None, None) if ids is None else (ids.to(self.device), None)
        self._tail_head = None
        self._draft_id_set = None if ids is None else set(ids.tolist())
        self._context_head = None

    def draft_head(self) -> torch.Tensor | lowbit.PackedWeight:
        """The drafts' head ``[H, N]``: the lm_head's columns of the draft vocabulary in the drafts' format (packed
        for speed once the verifying path is on: the verifier checks every draft), copied once."""
        if self._draft_head is None:
            if self.draft_format is not None and self.draft_weights is not self.weights:
                m = self.model
                dense = m.lm_head.weight if m.lm_head is not None else m.lm_head_t  # [H, V]
                assert dense is not None
                cols = dense if self.draft_ids is None else dense[:, self.draft_ids]
                self._draft_head = lowbit.pack(cols.t(), self.draft_format)
            else:
                self._draft_head = self.tail_head()
        return self._draft_head

    def tail_head(self) -> torch.Tensor | lowbit.PackedWeight:
        """The unverified profile's tail head ``[H, N]``: the engine's own lm_head, its columns of the draft
        vocabulary — never the drafts' packed copy, so a tail token is the same whether or not an exact request ever
        switched the verifying path on."""
        if self._tail_head is None:
            full, ids = self.head, self.draft_ids
            if ids is None:
                self._tail_head = full
            elif isinstance(full, lowbit.PackedWeight):
                self._tail_head = full.rows(ids)
            else:
                self._tail_head = full[:, ids].contiguous()
        return self._tail_head

    def _right_aligned(self, last: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions [n, R] of ``counts[i]`` positions ending at ``last[i]``, right-aligned; valid mask."""
        dev = self.device
        R = max(counts)
        offs = torch.arange(R - 1, -1, -1, device=dev)
        pos = (torch.tensor(last, device=dev)[:, None] - offs[None, :]).clamp(min=0)
        if all(c == R for c in counts):
            return pos, None
        return pos, offs[None, :] < torch.tensor(counts, device=dev)[:, None]

    def _context(self, kv_rows: list[int], positions: torch.Tensor, valid: torch.Tensor | None) -> StepContext:
        """Context for rows at ``positions`` [B, S] (valid [B, S] marks real, non-padding entries)."""
        self.cache.sync()
        B, S = positions.shape
        dev = self.device
        kv_row_t = torch.tensor(kv_rows, dtype=torch.long, device=dev)
        read_len = int(positions.max()) + 1
        mask = None  # a single row at a single position attends to every key up to read_len
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
        return StepContext(cos, sin, mask, read_len, kv_row_t, self.cache.table, write_kv_rows, write_pos, rows)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], prompts: list[Sequence] | None = None) -> torch.Tensor:
        """One position per row; heads refill and run the thinking group. Logits [B, V].

        ``prompts``: sequences of the unverified profile whose positions ``num_prefilled .. prefill_end`` ride along
        as rows of the same calls (:meth:`_decode_with_prompts`); what :meth:`prefill` would return for them is left in
        ``prompt_logits``."""
        if prompts:
            return self._decode_with_prompts(seqs, prompts)
        m, d, dev = self.model, self.dmtd, self.device
        kv_rows = [s.kv_row for s in seqs]
        pos = torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=dev)
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=dev)
        ctx = self._context(kv_rows, pos, None)
        h_enc = m.run_layers(m.embed_tokens(ids).to(self.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             self.kv, ctx, self.weights)
        heads = [i for i, s in enumerate(seqs) if s.next_is_head]
        tails = [i for i, s in enumerate(seqs) if not s.next_is_head]
        x = h_enc
        if tails:
            t_kv_rows = torch.tensor([kv_rows[i] for i in tails], device=dev)
            t_idx = torch.tensor([seqs[i].num_to_refill for i in tails], device=dev)
            self.cache.tail_enc[t_kv_rows, t_idx] = h_enc[torch.tensor(tails, device=dev), 0]
        if heads:
            h_think = self._refill([seqs[i] for i in heads], h_enc[heads])
            x = h_enc.clone()
            head_rows = torch.tensor(heads, device=dev)
            x[head_rows] = h_think + h_enc[head_rows] if d.head_input == "residual_add" else h_think
        h = m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.kv, ctx, self.weights)
        return self._decode_logits(h[:, 0], tails, bool(heads))

    def _decode_with_prompts(self, seqs: list[Sequence], prompts: list[Sequence]) -> torch.Tensor:
        """:meth:`decode` with prompt rows in the same ``dmtd::rows_layers`` calls (prompts run as rows:
        :meth:`rows_prefill`), as :meth:`_verify_with_prompts` rides them on a check: the encoding and decoding groups
        over the decode rows and then each prompt's positions, the thinking group over the heads' refill rows (their
        pending tails and the head) and the prompts' positions. A prompt's rows share the step's weight reads instead
        of taking a step of their own while the other rows wait; every row is computed alone, so each has the bits it
        has in a pass of its own."""
        m, d, dev = self.model, self.dmtd, self.device
        self.cache.sync()
        B = len(seqs)
        riding = self._riding_rows(prompts)
        spans = riding.spans
        ids = [s.token_ids[-1] for s in seqs] + riding.ids
        pos = torch.tensor([s.position for s in seqs] + riding.pos, device=dev)
        kv_rows = torch.tensor([s.kv_row for s in seqs] + riding.kv_rows, device=dev)
        is_prompt = torch.tensor([False] * B + riding.prompt, device=dev)
        ctx = self._rows_context(kv_rows, pos, is_prompt)
        h_enc = m.run_rows(m.embed_tokens(torch.tensor([ids], device=dev)).to(self.act_dtype), 0, d.thinking_start,
                           self.kv, ctx, self.weights)
        heads = [i for i, s in enumerate(seqs) if s.next_is_head]
        tails = [i for i, s in enumerate(seqs) if not s.next_is_head]
        if tails:
            t = torch.tensor(tails, device=dev)
            t_idx = torch.tensor([seqs[i].num_to_refill for i in tails], device=dev)
            self.cache.tail_enc[kv_rows[t], t_idx] = h_enc[0, t]
        # the thinking group: each head's pending tails and the head (as _refill), then the prompts' positions
        parts: list[torch.Tensor] = []
        t_pos: list[int] = []
        t_kv: list[int] = []
        ends: list[int] = []
        for i in heads:
            s, n = seqs[i], seqs[i].num_to_refill
            if n:
                parts.append(self.cache.tail_enc[s.kv_row, :n])
            parts.append(h_enc[0, i: i + 1])
            t_pos += range(s.position - n, s.position + 1)
            t_kv += [s.kv_row] * (n + 1)
            ends.append(len(t_pos) - 1)
        nt = len(t_pos)
        parts.append(h_enc[0, B:])
        think_ctx = self._rows_context(torch.cat((torch.tensor(t_kv, dtype=torch.long, device=dev), kv_rows[B:])),
                                       torch.cat((torch.tensor(t_pos, dtype=torch.long, device=dev), pos[B:])),
                                       torch.cat((torch.zeros(nt, dtype=torch.bool, device=dev), is_prompt[B:])))
        h_think = m.run_rows(torch.cat(parts)[None], d.thinking_start, d.decoding_start, self.kv, think_ctx,
                             self.weights)
        # the decoding group: tails their encoding output, heads the deep state, prompts by the phase rules
        x = h_enc.clone()
        if heads:
            rows = torch.tensor(heads, device=dev)
            hh = h_think[0, ends]
            x[0, rows] = hh + h_enc[0, rows] if d.head_input == "residual_add" else hh
        head = torch.cat([self._heads(s, torch.arange(a, b, device=dev)) for s, (a, b) in zip(prompts, spans)])[None]
        x[:, B:] = route_decoding_input(h_enc[:, B:], h_think[:, nt:], head, d.head_input)
        h = m.run_rows(x, d.decoding_start, d.num_layers, self.kv, ctx, self.weights)
        self.prompt_logits = self._riders_logits(h[0], B, prompts, spans)
        return self._decode_logits(h[0, :B], tails, bool(heads))

    def _decode_logits(self, h: torch.Tensor, tails: list[int], any_head: bool) -> torch.Tensor:
        """Logits [B, V] of a plain decode step. With a draft vocabulary, tail rows score only its ids (the
        rest -inf) whatever else shares the step; a step of tails alone projects onto those ids only."""
        ids = self.draft_ids
        if ids is None or not tails:
            return self.logits(h)
        if not any_head:
            small = project(self.model.norm.forward(h), self.tail_head())
            out = small.new_full((h.shape[0], self.model.config.vocab_size), float("-inf"))
            out[:, ids] = small
            return out
        logits = self.logits(h)
        rows = torch.tensor(tails, device=h.device)
        kept = logits[rows][:, ids]
        logits[rows] = float("-inf")
        logits[rows[:, None], ids[None, :]] = kept
        return logits

    def _refill(self, seqs: list[Sequence], h_head: torch.Tensor) -> torch.Tensor:
        """Thinking group over each head row's pending tails + the head, right-aligned. → [n, 1, H]."""
        dev = self.device
        n_new = [s.num_to_refill + 1 for s in seqs]
        R = max(n_new)
        if R == 1:
            inp = h_head
            pos = torch.tensor([[s.position] for s in seqs], device=dev)
            valid = None
        else:
            inp = torch.zeros(len(seqs), R, h_head.shape[-1], dtype=self.act_dtype, device=dev)
            inp[:, -1] = h_head[:, 0]
            for i, s in enumerate(seqs):
                if n_new[i] > 1:
                    inp[i, R - n_new[i]: R - 1] = self.cache.tail_enc[s.kv_row, : n_new[i] - 1]
            pos, valid = self._right_aligned([s.position for s in seqs], n_new)
        ctx = self._context([s.kv_row for s in seqs], pos, valid)
        out = self.model.run_layers(inp, self.dmtd.thinking_start, self.dmtd.decoding_start, ctx.cos, ctx.sin,
                                    self.kv, ctx, self.weights)
        return out[:, -1:]


def _weight_bytes(w: object) -> int:
    if isinstance(w, lowbit.PackedWeight):
        return w.data.numel() * w.data.element_size() + w.scales.numel() * w.scales.element_size()
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0


def _layer_bytes(layers: list[LayerWeights]) -> int:
    return sum(_weight_bytes(t) for lw in layers for t in lw)
