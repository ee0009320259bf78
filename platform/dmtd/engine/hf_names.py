"""Hugging Face tensor names ↔ the engine's fused ones (qkv_proj, gate_up_proj, transposed weights), both ways."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from dmtd.engine.config import ConfigError, ModelConfig


def fused_state_dict(cfg: ModelConfig, expected: Mapping[str, torch.Tensor],
                     sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of a model of ``cfg`` whose own tensors are ``expected`` (its ``state_dict()``: names and
    shapes), from HF names (``model.layers.N.self_attn.q_proj.weight`` …), shapes checked."""
    own: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        for key in (name, "model." + name):
            if key in sd:
                return sd[key]
        raise ConfigError(f"checkpoint is missing tensor {name!r}")

    own["embed_tokens.weight"] = take("embed_tokens.weight")
    own["norm.weight"] = take("norm.weight")
    if "lm_head.weight" in expected:  # an untied head
        own["lm_head.weight"] = sd.get("lm_head.weight", own["embed_tokens.weight"]).t()
    for i in range(cfg.num_layers):
        own.update(fused_layer(cfg, take, i))
    for k, t in own.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ConfigError(f"tensor {k} has shape {tuple(t.shape)}, config implies {tuple(expected[k].shape)}")
    return {k: v.contiguous() for k, v in own.items()}


def fused_layer(cfg: ModelConfig, take: Callable[[str], torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s tensors under the engine's names, fused from HF ones (``take(name)`` reads one, without the
    ``model.`` prefix)."""
    own: dict[str, torch.Tensor] = {}
    p = f"layers.{i}."
    a = p + "self_attn."
    own[a + "qkv_proj.weight"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"]).t()
    if cfg.qkv_bias:
        own[a + "qkv_proj.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
    own[a + "o_proj.weight"] = take(a + "o_proj.weight").t()
    if cfg.qk_norm:
        own[a + "q_norm.weight"] = take(a + "q_norm.weight")
        own[a + "k_norm.weight"] = take(a + "k_norm.weight")
    own[p + "mlp.gate_up_proj.weight"] = torch.cat(
        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
    ).t()
    own[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight").t()
    for n in ("input_layernorm", "post_attention_layernorm"):
        own[p + n + ".weight"] = take(p + n + ".weight")
    return own


def hf_state_dict(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a model of ``cfg`` (its ``state_dict()``) under HF names (unfused), for checkpoints and tests."""
    out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"]}
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = sd["lm_head.weight"].t()
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            fused = sd[p + f"self_attn.qkv_proj.{kind}"]
            wq, wk, wv = (fused.t() if kind == "weight" else fused).split((q, kv, kv))
            out[hp + f"self_attn.q_proj.{kind}"] = wq
            out[hp + f"self_attn.k_proj.{kind}"] = wk
            out[hp + f"self_attn.v_proj.{kind}"] = wv
        out[hp + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"].t()
        if cfg.qk_norm:
            out[hp + "self_attn.q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[hp + "self_attn.k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        g, u = sd[p + "mlp.gate_up_proj.weight"].t().chunk(2)
        out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = g, u
        out[hp + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"].t()
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[hp + n + ".weight"] = sd[p + n + ".weight"]
    return {k: v.contiguous() for k, v in out.items()}
