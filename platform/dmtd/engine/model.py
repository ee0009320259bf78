"""A lean Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) with DMTD layer-group routing.

Two ways to run it:

* ``forward_masked`` — the training-time cyclical-masking forward over whole sequences (design.md §1);
* ``run_layers`` with a :class:`StepContext` — incremental steps against the preallocated KV cache,
  used by :mod:`dmtd.engine.runner`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dmtd.engine.config import ConfigError, DMTDConfig, ModelConfig
from dmtd.engine.rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@dataclass(slots=True)
class StepContext:
    """Where one incremental step reads and writes the KV cache.

    Rows are sequences, columns are the new positions of each row (right-aligned; padding is masked
    out and never written). ``slot_range`` is set when the rows are cache slots ``a..a+B-1`` in order,
    so attention reads a view instead of gathering.
    """

    cos: torch.Tensor  # [B, 1, S, Dh]
    sin: torch.Tensor
    attn_mask: torch.Tensor  # [B, 1, S, Lk] bool, True = attend
    read_len: int  # Lk
    slots: torch.Tensor  # [B] int64
    slot_range: tuple[int, int] | None
    write_slots: torch.Tensor  # [N] slot of each valid new position
    write_pos: torch.Tensor  # [N] its position
    write_rows: torch.Tensor | None  # [N] flat index into B*S of each valid new position (None: all)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.split = (q, kv, kv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                ctx: StepContext | None = None) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is None or ctx is None:
            out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        else:
            k_cache, v_cache = cache
            new_k = k.transpose(1, 2).reshape(B * S, self.num_kv_heads, self.head_dim)
            new_v = v.reshape(B * S, self.num_kv_heads, self.head_dim)
            if ctx.write_rows is not None:
                new_k, new_v = new_k[ctx.write_rows], new_v[ctx.write_rows]
            k_cache[ctx.write_slots, :, ctx.write_pos] = new_k
            v_cache[ctx.write_slots, :, ctx.write_pos] = new_v
            if ctx.slot_range is not None:
                a, b = ctx.slot_range
                keys, values = k_cache[a:b, :, : ctx.read_len], v_cache[a:b, :, : ctx.read_len]
            else:
                keys, values = k_cache[ctx.slots, :, : ctx.read_len], v_cache[ctx.slots, :, : ctx.read_len]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.attn_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                ctx: StepContext | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        length = rope_len or cfg.max_position_embeddings
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                               length)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), self.lm_weight)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, S, Dh] for integer positions [B, S]."""
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def run_layers(self, h: torch.Tensor, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor,
                   caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                   ctx: StepContext | None = None) -> torch.Tensor:
        for i in range(start, end):
            h = self.layers[i](h, cos, sin, None if caches is None else caches[i], ctx)
        return h

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
        """Training-time cyclical-masking forward: logits [B, T, V] (design.md §1)."""
        h_enc, h_think = self.forward_lower(input_ids, dmtd)
        x = route_decoding_input(h_enc, h_think, head_mask, dmtd.head_input)
        return self.forward_decoding(x, dmtd)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face tensor names (``model.layers.N.self_attn.q_proj.weight`` …), fusing projections."""
        cfg = self.config
        own: dict[str, torch.Tensor] = {}

        def take(name: str) -> torch.Tensor:
            for key in (name, "model." + name):
                if key in sd:
                    return sd[key]
            raise ConfigError(f"checkpoint is missing tensor {name!r}")

        own["embed_tokens.weight"] = take("embed_tokens.weight")
        own["norm.weight"] = take("norm.weight")
        if self.lm_head is not None:
            own["lm_head.weight"] = sd.get("lm_head.weight", own["embed_tokens.weight"])
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            own[a + "qkv_proj.weight"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"])
            if cfg.qkv_bias:
                own[a + "qkv_proj.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
            own[a + "o_proj.weight"] = take(a + "o_proj.weight")
            if cfg.qk_norm:
                own[a + "q_norm.weight"] = take(a + "q_norm.weight")
                own[a + "k_norm.weight"] = take(a + "k_norm.weight")
            own[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            )
            own[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
            for n in ("input_layernorm", "post_attention_layernorm"):
                own[p + n + ".weight"] = take(p + n + ".weight")
        expected = {k: v.shape for k, v in self.state_dict().items()}
        for k, t in own.items():
            if tuple(t.shape) != tuple(expected[k]):
                raise ConfigError(f"tensor {k} has shape {tuple(t.shape)}, config implies {tuple(expected[k])}")
        self.load_state_dict(own, strict=True)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`load_hf_state_dict` (unfused HF names), for checkpoints and tests."""
        cfg = self.config
        sd = self.state_dict()
        out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"]}
        if self.lm_head is not None:
            out["lm_head.weight"] = sd["lm_head.weight"]
        q, kv, _ = self.layers[0].self_attn.split
        for i in range(cfg.num_layers):
            p, hp = f"layers.{i}.", f"model.layers.{i}."
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                wq, wk, wv = sd[p + f"self_attn.qkv_proj.{kind}"].split((q, kv, kv))
                out[hp + f"self_attn.q_proj.{kind}"] = wq
                out[hp + f"self_attn.k_proj.{kind}"] = wk
                out[hp + f"self_attn.v_proj.{kind}"] = wv
            out[hp + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
            if cfg.qk_norm:
                out[hp + "self_attn.q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
                out[hp + "self_attn.k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
            g, u = sd[p + "mlp.gate_up_proj.weight"].chunk(2)
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = g, u
            out[hp + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
            for n in ("input_layernorm", "post_attention_layernorm"):
                out[hp + n + ".weight"] = sd[p + n + ".weight"]
        return {k: v.contiguous() for k, v in out.items()}
