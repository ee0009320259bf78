"""A lean Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) with DMTD layer-group routing.

Two ways to run it:

* ``forward_masked`` — the training-time cyclical-masking forward over whole sequences (docs/design.md §1);
* ``run_layers`` with a :class:`StepContext` — incremental steps against the preallocated KV cache,
  used by :mod:`dmtd.engine.runner`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dmtd.engine.config import DMTDConfig, ModelConfig
from dmtd.engine.decode_kernel import decode_layers
from dmtd.engine.hf_names import fused_state_dict, hf_state_dict
from dmtd.engine.kv_cache import gather_pages
from dmtd.engine.rope import apply_rope, rope_tables


def project(x: torch.Tensor, w: Any) -> torch.Tensor:
    """``x @ w`` for an input-major weight ``[in, out]``; a packed weight (:mod:`dmtd.engine.lowbit`) brings
    its own product."""
    return torch.matmul(x, w) if isinstance(w, torch.Tensor) else w.project(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Written out (not F.rms_norm): on CPU the fused op decomposes into more, slower kernels. Half precision is
    # normalised in float32: torch's bf16 mean gives a row different bits depending on how many rows share the
    # call, the float32 one does not (and the exact profile compares rows computed in different batches).
    if x.dtype in (torch.bfloat16, torch.float16):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Proj(nn.Module):
    """A linear layer whose weight is stored input-major ``[in, out]``.

    ``x @ W`` streams this layout measurably faster than ``F.linear`` on the HF ``[out, in]`` layout
    for the batch-1 matrix-vector products that dominate decoding on CPU (no per-call transpose either).
    """

    def __init__(self, n_in: int, n_out: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        nn.init.normal_(self.weight, std=n_in ** -0.5)
        self.packed: Any = None  # the weight in a packed format (dmtd.engine.lowbit), set by adopt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = project(x, self.served())
        return y if self.bias is None else y + self.bias

    def served(self) -> Any:
        """The weight every pass multiplies by: the packed one once adopted, else the dense parameter."""
        return self.weight if self.packed is None else self.packed

    def adopt(self, packed: Any) -> None:
        """Serve ``packed`` (the same values in a kernel's layout) and free the dense copy: an engine's replica then
        holds its weights once. The dense parameter becomes empty (no training, no checkpoint from here on)."""
        self.packed = packed
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


@dataclass(slots=True)
class StepContext:
    """Where one incremental step reads and writes the paged KV cache.

    Rows are sequences, columns are the new positions of each row (right-aligned; padding is masked
    out and never written). A sequence's position ``t`` sits at offset ``t % page_size`` of page
    ``table[its cache row, t // page_size]`` (:mod:`dmtd.engine.kv_cache`).
    """

    cos: torch.Tensor  # [B, 1, S, Dh]
    sin: torch.Tensor
    attn_mask: torch.Tensor | None  # [B, 1, S, Lk] bool, True = attend; None = every key up to Lk
    read_len: int  # Lk
    kv_rows: torch.Tensor  # [B] int64: each row's cache row (its page-table row)
    table: torch.Tensor  # [cache rows, pages] int64
    write_kv_rows: torch.Tensor  # [N] cache row of each valid new position
    write_pos: torch.Tensor  # [N] its position
    write_rows: torch.Tensor | None  # [N] flat index into B*S of each valid new position (None: all)
    # [N] bool: which new positions are a prompt's (the rows op attends to them on AMX tiles where it can:
    # kernels/attend_amx.h); None: none (decode rows, checks, drafts)
    prompt_rows: torch.Tensor | None = None


class LayerWeights(NamedTuple):
    """One decoder layer's tensors, gathered once so the hot loop does no module attribute lookups."""

    ln1: torch.Tensor
    qkv: torch.Tensor  # [H, (nh + 2 nkv) * hd], input-major
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Proj(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = Proj(q, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.split = (q, kv, kv)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Proj(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Proj(cfg.intermediate_size, cfg.hidden_size)


class DecoderLayer(nn.Module):
    """Parameter container with HF-compatible names; the computation is :func:`layer_forward`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def weights(self) -> LayerWeights:
        at = self.self_attn
        return LayerWeights(
            self.input_layernorm.weight, at.qkv_proj.served(), at.qkv_proj.bias,
            None if at.q_norm is None else at.q_norm.weight, None if at.k_norm is None else at.k_norm.weight,
            at.o_proj.served(), self.post_attention_layernorm.weight, self.mlp.gate_up_proj.served(),
            self.mlp.down_proj.served(),
        )


def attention(w: LayerWeights, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: tuple[torch.Tensor, torch.Tensor] | None, ctx: StepContext | None) -> torch.Tensor:
    """Self-attention; without a cache it is causal over ``x``, with one it writes then reads the cache."""
    B, S, _ = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = project(x, w.qkv)
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    qkv = qkv.view(B, S, nh + 2 * nkv, hd)
    qk, v = qkv[:, :, : nh + nkv], qkv[:, :, nh + nkv:]
    if w.q_norm is not None and w.k_norm is not None:
        eps = cfg.rms_norm_eps
        qk = torch.cat((rms_norm(qk[:, :, :nh], w.q_norm, eps), rms_norm(qk[:, :, nh:], w.k_norm, eps)), dim=2)
    qk = apply_rope(qk.transpose(1, 2), cos, sin)  # one rope pass over q and k together
    q, k = qk[:, :nh], qk[:, nh:]
    if cache is None or ctx is None:
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return project(out.transpose(1, 2).reshape(B, S, -1), w.o)
    k_cache, v_cache = cache
    new_k = k.transpose(1, 2).reshape(B * S, nkv, hd).to(k_cache.dtype)
    new_v = v.reshape(B * S, nkv, hd).to(v_cache.dtype)
    if ctx.write_rows is not None:
        new_k, new_v = new_k[ctx.write_rows], new_v[ctx.write_rows]
    P = k_cache.shape[2]
    page, off = ctx.table[ctx.write_kv_rows, ctx.write_pos // P], ctx.write_pos % P
    k_cache[page, :, off] = new_k
    v_cache[page, :, off] = new_v
    keys = gather_pages(k_cache, ctx.table, ctx.kv_rows, ctx.read_len)
    values = gather_pages(v_cache, ctx.table, ctx.kv_rows, ctx.read_len)
    if keys.dtype == torch.bfloat16 and x.dtype == torch.float32:  # a bf16 cache beside float32 activations
        keys, values = keys.float(), values.float()  # (kv_cache_dtype): widened exactly, summed in float32
    if S == 1:
        # Decode: group the query heads by their KV head and use two batched matmuls; far less
        # fixed overhead than SDPA for a single query row.
        g = nh // nkv
        scores = torch.matmul(q.view(B, nkv, g, hd).to(keys.dtype), keys.transpose(-1, -2)) * (hd ** -0.5)
        if ctx.attn_mask is not None:
            scores = scores.masked_fill(~ctx.attn_mask.view(B, 1, 1, -1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values).to(x.dtype)
        return project(out.reshape(B, 1, nh * hd), w.o)
    out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=ctx.attn_mask,
                                         enable_gqa=True).to(x.dtype)
    return project(out.transpose(1, 2).reshape(B, S, -1), w.o)


def layer_forward(w: LayerWeights, cfg: ModelConfig, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ctx: StepContext | None = None) -> torch.Tensor:
    """Pre-norm decoder layer: attention then SwiGLU MLP, each with a residual."""
    eps = cfg.rms_norm_eps
    h = h + attention(w, cfg, rms_norm(h, w.ln1, eps), cos, sin, cache, ctx)
    gate, up = project(rms_norm(h, w.ln2, eps), w.gate_up).chunk(2, dim=-1)
    return h + project(F.silu(gate) * up, w.down)


def route_decoding_input(h_enc: torch.Tensor, h_think: torch.Tensor, head_mask: torch.Tensor,
                         head_input: str) -> torch.Tensor:
    """Decoding-group input: heads see the deep state (added to or replacing ``h_enc``), tails ``h_enc``."""
    m = head_mask.to(h_enc.dtype).unsqueeze(-1)
    if head_input == "residual_add":
        return h_enc + h_think * m
    return h_think * m + h_enc * (1 - m)


class Transformer(nn.Module):
    """The decoder stack; layer groups are index ranges given by a :class:`DMTDConfig`."""

    def __init__(self, cfg: ModelConfig, rope_len: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Proj(cfg.hidden_size, cfg.vocab_size)
        self.lm_head_t: torch.Tensor | None = None  # [H, V] copy of tied embeddings for fast decoding
        length = rope_len or cfg.max_position_embeddings
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                               length)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._weights: list[LayerWeights] | None = None
        self.row_loop = 8  # chunks of one sequence up to this many positions attend row by row (decode_kernel)
        self.attend_kernel = False  # decode attention by dmtd::attend (set by the engine's runner where it is built)
        # decode rows through packed weights by dmtd::rows_layers, a layer group in one call (set by the runner)
        self.fused_layers = False
        self._fused_args: dict[tuple[int, int, int, int], tuple[Any, Any, Any]] = {}

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self._weights, self.lm_head_t = None, None  # .to()/.float() may replace the tensors
        self._fused_args = {}
        return super()._apply(fn, recurse)

    def layer_weights(self) -> list[LayerWeights]:
        if self._weights is None:
            self._weights = [layer.weights() for layer in self.layers]  # type: ignore[operator]
        return self._weights

    def rows_args(self, weights: list[LayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                   end: int) -> tuple[int, list[list[torch.Tensor]]] | None:
        """``dmtd::rows_layers``' packed format and list arguments for layers ``start..end`` (gathered once per
        weights and cache lists; the qkv biases and q/k norms as float32, empty lists where the model has none): None
        where a projection is not packed, the formats differ, or the KV is not contiguous float32 or bfloat16."""
        key = (id(weights), id(caches), start, end)
        hit = self._fused_args.get(key)
        if hit is not None and hit[0] is weights and hit[1] is caches:
            return hit[2]
        cols: list[list[torch.Tensor]] = [[] for _ in range(15)]
        modes: set[int] = set()
        ok = True

        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.float().contiguous()

        for i in range(start, end):
            w, (k, v) = weights[i], caches[i]
            ps: list[Any] = [p for p in (w.qkv, w.o, w.gate_up, w.down) if not isinstance(p, torch.Tensor)]
            if (len(ps) < 4 or k.dtype not in (torch.float32, torch.bfloat16)
                    or not (k.is_contiguous() and v.is_contiguous())):
                ok = False
                break
            modes |= {int(p.mode) for p in ps}
            row = (f32(w.ln1), ps[0].data, ps[0].scales, ps[1].data, ps[1].scales,
                   f32(w.ln2), ps[2].data, ps[2].scales, ps[3].data, ps[3].scales, k, v)
            for c, t in zip(cols, row):
                c.append(t)
            for c, opt in zip(cols[12:], (w.qkv_bias, w.q_norm, w.k_norm)):
                if opt is not None:
                    c.append(f32(opt))
        ok = ok and all(len(c) in (0, end - start) for c in cols[12:])  # every layer of the group has them, or none
        out = (modes.pop(), cols) if ok and len(modes) == 1 else None
        self._fused_args[key] = (weights, caches, out)
        return out

    def forget_rows_args(self, weights: list[LayerWeights]) -> None:
        """Drop the rows op's arguments gathered for ``weights`` (a variant's layers, let go)."""
        self._fused_args = {k: v for k, v in self._fused_args.items() if v[0] is not weights}

    def _fused_rows(self, h: torch.Tensor, ctx: StepContext, mode: int, cols: list[list[torch.Tensor]]) -> torch.Tensor:
        """A layer group over the valid entries of ``h`` [B, S, H] by ``dmtd::rows_layers`` (padding entries come
        back as they went in: nothing reads them)."""
        cfg = self.config
        B, S, H = h.shape
        flat = h.reshape(B * S, H)
        x = flat if ctx.write_rows is None else flat[ctx.write_rows]
        cos, sin = self.rope_cos, self.rope_sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        pos = ctx.write_pos
        out = torch.ops.dmtd.rows_layers(x, *cols, ctx.table, cos[pos], sin[pos], ctx.write_kv_rows, pos, cfg.num_heads,
                                         cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, mode, ctx.prompt_rows)
        if ctx.write_rows is None:
            return out.view(B, S, H)
        res = flat.clone()
        res[ctx.write_rows] = out
        return res.view(B, S, H)

    def _decode_kernel(self, h: torch.Tensor, start: int, end: int,
                       caches: list[tuple[torch.Tensor, torch.Tensor]], ctx: StepContext,
                       weights: list[LayerWeights]) -> torch.Tensor:
        """One position per row through layers ``start..end`` with the TorchScript decode loop."""
        if start == end:
            return h
        cfg, ws = self.config, weights[start:end]
        shared = h.shape[0] == 1 and h.shape[1] > 1  # a chunk of one sequence: its positions become the rows
        rows = h.shape[1] if shared else h.shape[0]
        if shared and not (int(ctx.write_pos[0]) == ctx.read_len - rows and int(ctx.write_pos[-1]) == ctx.read_len - 1):
            raise ValueError("a chunk of one sequence must hold consecutive positions ending at read_len - 1")
        mask = None if ctx.attn_mask is None else ctx.attn_mask.reshape(rows, ctx.read_len)
        cos, sin = (ctx.cos[0, 0], ctx.sin[0, 0]) if shared else (ctx.cos[:, 0, 0], ctx.sin[:, 0, 0])
        mode = 0 if isinstance(ws[0].qkv, torch.Tensor) else int(ws[0].qkv.mode)  # packed (dmtd.engine.lowbit)
        if mode:
            proj = [[getattr(w, f).data for w in ws] for f in ("qkv", "o", "gate_up", "down")]
            scales: list[list[torch.Tensor] | None] = [[getattr(w, f).scales for w in ws]
                                                       for f in ("qkv", "o", "gate_up", "down")]
        else:
            proj, scales = [[getattr(w, f) for w in ws] for f in ("qkv", "o", "gate_up", "down")], [None] * 4
        out = decode_layers(
            h[0] if shared else h[:, 0], [w.ln1 for w in ws], proj[0],
            None if ws[0].qkv_bias is None else [w.qkv_bias for w in ws],
            None if ws[0].q_norm is None else [w.q_norm for w in ws],
            None if ws[0].k_norm is None else [w.k_norm for w in ws],
            proj[1], [w.ln2 for w in ws], proj[2], proj[3],
            [c[0] for c in caches[start:end]], [c[1] for c in caches[start:end]],
            cos, sin, ctx.write_kv_rows, ctx.write_pos, ctx.table, ctx.read_len, mask, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.rms_norm_eps, shared, mode, *scales,
            self.row_loop, self.attend_kernel and caches[start][0].dtype in (torch.float32, torch.bfloat16),
        )
        return out.unsqueeze(0) if shared else out.unsqueeze(1)

    @property
    def packed(self) -> bool:
        """Whether the layers' projections serve packed weights (:meth:`Proj.adopt`): the dense ones are gone."""
        return any(p.packed is not None for p in self.modules() if isinstance(p, Proj))

    def pack_projections(self, pack: Callable[[torch.Tensor], Any]) -> None:
        """Every layer's projections serve ``pack(dense [out, in])`` from here on, their dense copies freed one at a
        time (:meth:`Proj.adopt`): the engine's kernels read the packed weights on every pass, so a replica holds
        them once, and packing peaks at the model plus one projection (gpt-fast's quantization handlers' move)."""
        self._weights, self._fused_args = None, {}
        with torch.no_grad():
            for layer in self.layers:
                at, mlp = layer.self_attn, layer.mlp
                projs: tuple[Proj, ...] = (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj)  # type: ignore[union-attr,assignment]
                for proj in projs:
                    if proj.packed is None:
                        proj.adopt(pack(proj.weight.t()))
        if self.lm_head is None and self.lm_head_t is not None:
            self.lm_head_t = self.embed_tokens.weight.detach().t()

    def prepare_inference(self) -> Transformer:
        """Frozen-weights setup for the engine: an input-major copy of tied embeddings for the lm_head (a view of
        them once the layers are packed: the engine then packs its own head, the dense one is read only for a few
        columns)."""
        if self.lm_head is None:
            w = self.embed_tokens.weight.detach().t()
            self.lm_head_t = w if self.packed else w.contiguous()
        return self

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm.forward(h)
        if self.lm_head is not None:
            return torch.matmul(h, self.lm_head.weight)
        if self.lm_head_t is not None and not torch.is_grad_enabled():
            return torch.matmul(h, self.lm_head_t)
        return F.linear(h, self.embed_tokens.weight)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, S, Dh] for integer positions [B, S]."""
        cos, sin = self.rope_cos, self.rope_sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def run_layers(self, h: torch.Tensor, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor,
                   caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                   ctx: StepContext | None = None, weights: list[LayerWeights] | None = None) -> torch.Tensor:
        """Layers ``start..end`` over ``h``; ``weights`` overrides the model's own (a verifier's path)."""
        cfg = self.config
        weights = weights if weights is not None else self.layer_weights()
        if (self.fused_layers and ctx is not None and caches is not None and not torch.is_grad_enabled()
                and h.shape[1] <= 16 and start < end):
            fused = self.rows_args(weights, caches, start, end)
            if fused is not None:
                return self._fused_rows(h, ctx, *fused)
        if ctx is not None and caches is not None and not torch.is_grad_enabled() and (
                h.shape[1] == 1 or (h.shape[0] == 1 and h.shape[1] <= 16 and ctx.write_rows is None)):
            return self._decode_kernel(h, start, end, caches, ctx, weights)
        for i in range(start, end):
            h = layer_forward(weights[i], cfg, h, cos, sin, None if caches is None else caches[i], ctx)
        return h

    def run_rows(self, h: torch.Tensor, start: int, end: int, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 ctx: StepContext, weights: list[LayerWeights]) -> torch.Tensor:
        """Layers ``start..end`` over rows ``h`` [1, R, H] by ``dmtd::rows_layers``: row r is position
        ``ctx.write_pos[r]`` of kv_row ``ctx.write_kv_rows[r]`` (any number of rows, of any kv_rows; the caller checked
        ``rows_args``)."""
        if start == end:
            return h
        fused = self.rows_args(weights, caches, start, end)
        assert fused is not None, "layers the rows op does not run"
        return self._fused_rows(h, ctx, *fused)

    def forward_lower(self, input_ids: torch.Tensor, dmtd: DMTDConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoding then thinking layers over whole sequences [B, T] → (h_enc, h_think)."""
        T = input_ids.shape[1]
        cos, sin = self.rope(torch.arange(T, device=input_ids.device).unsqueeze(0))
        h_enc = self.run_layers(self.embed_tokens(input_ids), 0, dmtd.thinking_start, cos, sin)
        h_think = self.run_layers(h_enc, dmtd.thinking_start, dmtd.decoding_start, cos, sin)
        return h_enc, h_think

    def forward_decoding(self, x: torch.Tensor, dmtd: DMTDConfig) -> torch.Tensor:
        """Decoding layers + norm + lm_head over whole sequences → logits [B, T, V]."""
        T = x.shape[1]
        cos, sin = self.rope(torch.arange(T, device=x.device).unsqueeze(0))
        return self.logits(self.run_layers(x, dmtd.decoding_start, len(self.layers), cos, sin))

    def forward_masked(self, input_ids: torch.Tensor, head_mask: torch.Tensor, dmtd: DMTDConfig) -> torch.Tensor:
        """Training-time cyclical-masking forward: logits [B, T, V] (docs/design.md §1)."""
        h_enc, h_think = self.forward_lower(input_ids, dmtd)
        x = route_decoding_input(h_enc, h_think, head_mask, dmtd.head_input)
        return self.forward_decoding(x, dmtd)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face tensor names (``model.layers.N.self_attn.q_proj.weight`` …), fusing projections."""
        self.load_state_dict(fused_state_dict(self.config, self.state_dict(), sd), strict=True)
        self.lm_head_t, self._weights = None, None

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`load_hf_state_dict` (unfused HF names), for checkpoints and tests."""
        if self.packed:
            raise ValueError("this model serves packed weights (its dense ones were freed): no checkpoint of it")
        return hf_state_dict(self.config, self.state_dict())
