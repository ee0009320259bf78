"""Runs scheduled batches through the model: plain decode steps mixing heads and tails itself, prompts through its
prefill runner, verified cycles' drafts and checks through its verified-pass runner."""

from __future__ import annotations

import math
import os

import torch

from dmtd.engine import lowbit
from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.draft_weights import DraftWeights, weight_bytes
from dmtd.engine.kv_cache import KVCache, bytes_per_position
from dmtd.engine.kv_pages import KVPages, pages_for
from dmtd.engine.model import LayerWeights, Transformer, project, route_decoding_input
from dmtd.engine.model_state import ModelState
from dmtd.engine.prefill import DeferredRows, PrefillRunner
from dmtd.engine.sequence import Sequence
from dmtd.engine.verified_passes import VerifiedPassRunner
from dmtd.engine.verifier import Verifier, own_verifier

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def attend_kernel_on() -> bool:
    """Whether decode rows attend through dmtd::attend here (kernels built; DMTD_ATTEND=0: torch's ops, to compare)."""
    return os.environ.get("DMTD_ATTEND", "1") != "0" and lowbit.kernels_available()


def kv_dtype_for(cfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element for ``cfg.kv_cache_dtype``: bfloat16 only for a bfloat16 model on the CPU where
    dmtd::attend reads the cache (kernels/attend.h widens each value exactly; torch's bf16 attention would round its
    sums), and not on the amx path (its prompt rows' tiles read float32); "auto" is float32 for such a model."""
    if cfg.kv_cache_dtype == "bfloat16":
        why = ("the model is not bfloat16" if dtype != torch.bfloat16 else "it runs on the CPU only"
               if device.type != "cpu" else "dmtd::attend is off here (no kernels, or DMTD_ATTEND=0)"
               if not attend_kernel_on() else "the amx path keeps float32" if lowbit.loaded_path() == "amx" else "")
        if why:
            raise ConfigError(f"kv_cache_dtype bfloat16: {why}; use auto or float32")
        return torch.bfloat16
    return torch.float32 if dtype == torch.bfloat16 else dtype  # auto, float32: the model's own or float32


class ModelRunner:
    """Owns the model, the engine's copies of its weights and its KV cache (``state``, a :class:`ModelState`); turns
    a batch of sequences into next-token logits.

    A decode step (:meth:`decode`, run here) runs, for every sequence, the encoding group and the decoding group at
    its position. Sequences at a head also run the thinking group over their pending tail positions plus the head,
    in one causal pass (cyclical refilling), before their decoding group. Its collaborators, each given what it
    needs: ``prefill_runner`` (:class:`PrefillRunner`: prompts, as rows or SDPA chunks), ``verified``
    (:class:`VerifiedPassRunner`: verified cycles' :meth:`draft` passes for their tails and :meth:`verify` checks
    for their heads, with the verifier's decoding-group weights and KV beside the tail path's) and ``drafts``
    (:class:`DraftWeights`: the draft vocabulary and the drafts' weights). The methods below that only pass a call
    on are the engine's interface to them.
    """

    def __init__(self, model: Transformer, dmtd: DMTDConfig, cfg: EngineConfig,
                 verifier: Verifier | None = None) -> None:
        dmtd.check_model(model.config)
        self.model, self.dmtd, self.cfg = model.prepare_inference(), dmtd, cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        # bf16 keeps its KV cache (and so attention) in float32 unless kv_cache_dtype asks for bfloat16 (see
        # kv_dtype_for): attention then computes a sequence the same way whatever else shares its step, which the
        # exact profile's equality with τ = 1 rests on
        self.kv_dtype = kv_dtype_for(cfg, self.dtype, self.device)
        self.verifier = verifier or own_verifier(dmtd, is_base=dmtd.head_input == "replace")
        have = next(model.parameters()).dtype
        if have != self.dtype:
            raise ConfigError(f"dtype is {cfg.dtype} but the model's weights are {str(have).removeprefix('torch.')}: "
                              "load the model in the engine's dtype")
        self.weight_format = lowbit.weight_format(cfg.dtype, cfg.quant, self.device.type)
        # decode steps attend through dmtd::attend where the kernels build: one call a layer, each sequence alone
        # (DMTD_ATTEND=0: torch's ops instead, to compare)
        self.model.attend_kernel = (self.device.type == "cpu" and self.kv_dtype in (torch.float32, torch.bfloat16)
                                    and attend_kernel_on())
        # decode rows of packed weights run a layer group in one call (dmtd::rows_layers, float32 throughout) where
        # the kernels build (DMTD_FUSED_LAYERS=0: the TorchScript loop instead, to compare)
        self.model.fused_layers = self.model.attend_kernel and os.environ.get("DMTD_FUSED_LAYERS", "1") != "0"
        self.weights, self.head = self._pack(self.weight_format)
        # Activations (the residual stream, pending tails, stashes) stay float32 on packed half-precision weights:
        # rounded to bf16 they were rounded wherever a layer group ends, and two engines that split the same layers
        # into different groups (a variant's verifier, the base model) gave a position different bits
        packed = self.weights is not self.model.layer_weights()
        self.act_dtype = torch.float32 if packed and self.dtype in (torch.bfloat16, torch.float16) else self.dtype
        self.cache = KVCache(model=model.config, dmtd=dmtd, num_rows=cfg.max_num_seqs, max_len=cfg.max_model_len,
                             pages=self._page_pool(model), dtype=self.kv_dtype, device=self.device,
                             hidden_dtype=self.act_dtype)
        self.kv = self.cache.layers
        vl = self.verifier.layers
        verify_weights = self.weights if vl is None else (
            self.weights[: dmtd.decoding_start] + self._pack_layers(vl, self.weight_format))
        self.state = ModelState(model=self.model, dmtd=dmtd, cfg=cfg, device=self.device, act_dtype=self.act_dtype,
                                weights=self.weights, head=self.head, kv=self.kv, cache=self.cache,
                                verifier=self.verifier, verify_weights=verify_weights)
        # drafts' weights: the tail path's encoding and decoding groups, packed for speed only (the verifier checks
        # every draft, so their precision changes acceptance, never the output); packed by enable_exact
        self.drafts = DraftWeights(self.state, lowbit.draft_format(cfg.draft_quant, self.device.type))
        self.prefill_runner = PrefillRunner(self.state, self.enable_exact)
        self.verified = VerifiedPassRunner(self.state, self.drafts, self.prefill_runner)

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

    def add_tails(self, name: str, decoding: list[LayerWeights]) -> int:
        """Another variant of this engine's trunk (the same split, base weights below the decoding group): its
        decoding group ``decoding`` (dense, in the model's dtype) in the engine's format, beside the engine's own.
        Returns the bytes its layers hold."""
        d = self.dmtd
        if len(decoding) != d.num_decoding_layers:
            raise ConfigError(f"variant {name!r}: {len(decoding)} decoding layers, this engine's trunk has "
                              f"{d.num_decoding_layers}")
        have = decoding[0].qkv.dtype
        if have != self.dtype:
            raise ConfigError(f"variant {name!r}: decoding layers in {str(have).removeprefix('torch.')}, the engine "
                              f"runs {self.cfg.dtype}")
        packed = self._pack_layers(decoding, self.weight_format)
        self.state.tails[name] = self.weights[: d.decoding_start] + packed
        self.drafts.forget(name)
        return sum(weight_bytes(t) for lw in packed for t in lw)

    def remove_tails(self, name: str) -> None:
        """Let a variant's layers go (none of its sequences may be left)."""
        layers = self.state.tails.pop(name)
        for w in [layers, *self.drafts.forget(name)]:
            self.model.forget_rows_args(w)

    def enable_exact(self) -> None:
        """Allocate the verifying path's KV and the drafts' weights (first use of verified cycles)."""
        if self.state.enable_verify():
            self.drafts.enable()

    # -- the engine's interface to the runner's collaborators --

    @property
    def verify_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return self.state.verify_kv

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The draft vocabulary (None: the full one)."""
        return self.drafts.ids

    @property
    def pass_draft_ids(self) -> torch.Tensor | None:
        """The last draft pass's columns: the draft vocabulary and its sequences' context ids."""
        return self.drafts.pass_ids

    @property
    def draft_format(self) -> str | None:
        return self.drafts.format

    @property
    def deferred(self) -> list[DeferredRows]:
        return self.prefill_runner.deferred

    @property
    def prompt_logits(self) -> torch.Tensor:
        """The last decode step's or check's riding prompts' logits (what :meth:`prefill` returns for them)."""
        return self.prefill_runner.prompt_logits

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        self.drafts.set_vocab(ids)

    def draft_head(self) -> torch.Tensor | lowbit.PackedWeight:
        return self.drafts.draft_head()

    def tail_head(self) -> torch.Tensor | lowbit.PackedWeight:
        return self.drafts.tail_head()

    def draft_bytes_share(self) -> float:
        return self.drafts.bytes_share()

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        return self.prefill_runner.prefill(seqs)

    def rows_prefill(self) -> bool:
        return self.prefill_runner.rows_prefill()

    def catch_up(self) -> torch.Tensor:
        return self.prefill_runner.catch_up()

    def owes_draft_kv(self, seq: Sequence) -> bool:
        return self.prefill_runner.owes_draft_kv(seq)

    def draft(self, seqs: list[Sequence]) -> torch.Tensor:
        return self.verified.draft(seqs)

    def verify(self, seqs: list[Sequence], prompts: list[Sequence] | None = None) -> torch.Tensor:
        return self.verified.verify(seqs, prompts)

    # -- the plain decode pass --

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], prompts: list[Sequence] | None = None) -> torch.Tensor:
        """One position per sequence; heads refill and run the thinking group. Logits [B, V].

        ``prompts``: sequences of the unverified profile whose positions ``num_prefilled .. prefill_end`` ride along
        as rows of the same calls (:meth:`_decode_with_prompts`); what :meth:`prefill` would return for them is left in
        ``prompt_logits``."""
        st = self.state
        if prompts:
            return self._decode_with_prompts(seqs, prompts)
        m, d, dev = st.model, st.dmtd, st.device
        kv_rows = [s.kv_row for s in seqs]
        pos = torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=dev)
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=dev)
        ctx = st.context(kv_rows, pos, None)
        h_enc = m.run_layers(m.embed_tokens(ids).to(st.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             st.kv, ctx, st.weights)
        heads = [i for i, s in enumerate(seqs) if s.next_is_head]
        tails = [i for i, s in enumerate(seqs) if not s.next_is_head]
        x = h_enc
        if tails:
            t_kv_rows = torch.tensor([kv_rows[i] for i in tails], device=dev)
            t_idx = torch.tensor([seqs[i].num_to_refill for i in tails], device=dev)
            st.cache.tail_enc[t_kv_rows, t_idx] = h_enc[torch.tensor(tails, device=dev), 0]
        if heads:
            h_think = self._refill([seqs[i] for i in heads], h_enc[heads])
            x = h_enc.clone()
            head_rows = torch.tensor(heads, device=dev)
            x[head_rows] = h_think + h_enc[head_rows] if d.head_input == "residual_add" else h_think
        h = st.decoding_batch(x, [s.variant for s in seqs], kv_rows, pos, None, ctx)
        return self._decode_logits(h[:, 0], tails, bool(heads))

    def _decode_with_prompts(self, seqs: list[Sequence], prompts: list[Sequence]) -> torch.Tensor:
        """:meth:`decode` with prompt rows in the same ``dmtd::rows_layers`` calls (prompts run as rows:
        :meth:`rows_prefill`), as :meth:`_verify_with_prompts` rides them on a check: the encoding and decoding groups
        over the decode rows and then each prompt's positions, the thinking group over the heads' refill rows (their
        pending tails and the head) and the prompts' positions. A prompt's rows share the step's weight reads instead
        of taking a step of their own while the other rows wait; every row is computed alone, so each has the bits it
        has in a pass of its own."""
        st = self.state
        m, d, dev = st.model, st.dmtd, st.device
        st.cache.sync()
        B = len(seqs)
        riding = PrefillRunner.riding_rows(prompts)
        spans = riding.spans
        ids = [s.token_ids[-1] for s in seqs] + riding.ids
        pos = torch.tensor([s.position for s in seqs] + riding.pos, device=dev)
        kv_rows = torch.tensor([s.kv_row for s in seqs] + riding.kv_rows, device=dev)
        is_prompt = torch.tensor([False] * B + riding.prompt, device=dev)
        ctx = st.rows_context(kv_rows, pos, is_prompt)
        h_enc = m.run_rows(m.embed_tokens(torch.tensor([ids], device=dev)).to(st.act_dtype), 0, d.thinking_start,
                           st.kv, ctx, st.weights)
        heads = [i for i, s in enumerate(seqs) if s.next_is_head]
        tails = [i for i, s in enumerate(seqs) if not s.next_is_head]
        if tails:
            t = torch.tensor(tails, device=dev)
            t_idx = torch.tensor([seqs[i].num_to_refill for i in tails], device=dev)
            st.cache.tail_enc[kv_rows[t], t_idx] = h_enc[0, t]
        # the thinking group: each head's pending tails and the head (as _refill), then the prompts' positions
        parts: list[torch.Tensor] = []
        t_pos: list[int] = []
        t_kv: list[int] = []
        ends: list[int] = []
        for i in heads:
            s, n = seqs[i], seqs[i].num_to_refill
            if n:
                parts.append(st.cache.tail_enc[s.kv_row, :n])
            parts.append(h_enc[0, i: i + 1])
            t_pos += range(s.position - n, s.position + 1)
            t_kv += [s.kv_row] * (n + 1)
            ends.append(len(t_pos) - 1)
        nt = len(t_pos)
        parts.append(h_enc[0, B:])
        think_ctx = st.rows_context(torch.cat((torch.tensor(t_kv, dtype=torch.long, device=dev), kv_rows[B:])),
                                       torch.cat((torch.tensor(t_pos, dtype=torch.long, device=dev), pos[B:])),
                                       torch.cat((torch.zeros(nt, dtype=torch.bool, device=dev), is_prompt[B:])))
        h_think = m.run_rows(torch.cat(parts)[None], d.thinking_start, d.decoding_start, st.kv, think_ctx,
                             st.weights)
        # the decoding group: tails their encoding output, heads the deep state, prompts by the phase rules
        x = h_enc.clone()
        if heads:
            rows = torch.tensor(heads, device=dev)
            hh = h_think[0, ends]
            x[0, rows] = hh + h_enc[0, rows] if d.head_input == "residual_add" else hh
        mask = self.prefill_runner.head_mask
        head = torch.cat([mask(s, torch.arange(a, b, device=dev)) for s, (a, b) in zip(prompts, spans)])[None]
        x[:, B:] = route_decoding_input(h_enc[:, B:], h_think[:, nt:], head, d.head_input)
        variants = [s.variant for s in seqs] + [s.variant for s, (a, b) in zip(prompts, spans) for _ in range(a, b)]
        h = st.decoding_rows(x, variants, lambda keep: st.rows_context(kv_rows[keep], pos[keep], is_prompt[keep]))
        self.prefill_runner.riders_logits(h[0], B, prompts, spans)
        return self._decode_logits(h[0, :B], tails, bool(heads))

    def _decode_logits(self, h: torch.Tensor, tails: list[int], any_head: bool) -> torch.Tensor:
        """Logits [B, V] of a plain decode step. With a draft vocabulary, tail sequences score only its ids (the
        rest -inf) whatever else shares the step; a step of tails alone projects onto those ids only."""
        st = self.state
        ids = self.drafts.ids
        if ids is None or not tails:
            return st.logits(h)
        if not any_head:
            small = project(st.model.norm.forward(h), self.drafts.tail_head())
            out = small.new_full((h.shape[0], st.model.config.vocab_size), float("-inf"))
            out[:, ids] = small
            return out
        logits = st.logits(h)
        rows = torch.tensor(tails, device=h.device)
        kept = logits[rows][:, ids]
        logits[rows] = float("-inf")
        logits[rows[:, None], ids[None, :]] = kept
        return logits

    def _refill(self, seqs: list[Sequence], h_head: torch.Tensor) -> torch.Tensor:
        """Thinking group over each head sequence's pending tails + the head, right-aligned. → [n, 1, H]."""
        st = self.state
        dev = st.device
        n_new = [s.num_to_refill + 1 for s in seqs]
        R = max(n_new)
        if R == 1:
            inp = h_head
            pos = torch.tensor([[s.position] for s in seqs], device=dev)
            valid = None
        else:
            inp = torch.zeros(len(seqs), R, h_head.shape[-1], dtype=st.act_dtype, device=dev)
            inp[:, -1] = h_head[:, 0]
            for i, s in enumerate(seqs):
                if n_new[i] > 1:
                    inp[i, R - n_new[i]: R - 1] = st.cache.tail_enc[s.kv_row, : n_new[i] - 1]
            pos, valid = st.right_aligned([s.position for s in seqs], n_new)
        ctx = st.context([s.kv_row for s in seqs], pos, valid)
        out = st.model.run_layers(inp, st.dmtd.thinking_start, st.dmtd.decoding_start, ctx.cos, ctx.sin,
                                    st.kv, ctx, st.weights)
        return out[:, -1:]
