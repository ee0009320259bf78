"""Rotary position embeddings with the scalings Llama-family configs ask for (default, linear, llama3, yarn)."""

from __future__ import annotations

import math
from typing import Any

import torch

from dmtd.engine.config import ConfigError


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[
    torch.Tensor, float
]:
    factor = float(s["factor"])
    orig = int(s.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low: float = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, float(mscale)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int) -> tuple[
    torch.Tensor, float
]:
    """Inverse frequencies and the attention scale factor for the configured rope type."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling, max_pos)
    raise ConfigError(f"rope_scaling.rope_type {kind!r} is not supported (default, linear, llama3, yarn)")


def rope_tables(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int,
                length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables of shape [length, head_dim] (fp32), HF ``rotate_half`` layout."""
    inv, mscale = rope_inv_freq(head_dim, theta, scaling, max_pos)
    pos = torch.arange(length, dtype=torch.int64).float()
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * mscale, signed_sin(emb.sin() * mscale)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, so rope needs a flip instead of ``rotate_half``'s cat/neg."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, D] by cos / :func:`signed_sin` tables [B, 1, S, D].

    Bitwise equal to HF's ``x * cos + rotate_half(x) * sin`` since both halves of ``sin`` are equal.
    """
    D = x.shape[-1]
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed
