"""The decode hot loop (one new position per row, or a short chunk of one sequence) compiled with TorchScript.

Decoding on CPU is bound by weight reads plus a fixed cost per tensor op; run from Python, that fixed
cost is ~2–3 µs per op × ~45 ops per layer. TorchScript runs the same ops from its C++ interpreter and
cuts the per-token time by ~8 % at batch 1 (measured by ``dmtd bench engine``). It computes exactly what
:func:`dmtd.engine.model.layer_forward` computes; the refill-equivalence tests hold it to that.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional  # noqa: UP035 — TorchScript wants typing's generics

import torch
import torch.nn.functional as F

import dmtd.engine.ops  # noqa: F401 — defines torch.ops.dmtd.linear before the loop is scripted


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _lin(x: torch.Tensor, w: torch.Tensor, s: Optional[List[torch.Tensor]], i: int, mode: int  # noqa: UP006, UP045
         ) -> torch.Tensor:
    """``x @ w`` for a dense input-major weight (mode 0), else the packed weight's kernel with scales ``s[i]``."""
    if mode == 0 or s is None:
        return torch.mm(x, w)
    return torch.ops.dmtd.linear(x, w, s[i], mode)


def _torch_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, s0: int, B: int,
                     one: bool, shared: bool, contiguous: bool, read_len: int, mask: Optional[torch.Tensor],  # noqa: UP045
                     nkv: int, g: int, hd: int, scale: float, row_loop: int) -> torch.Tensor:
    """The decode rows' attention with torch's ops (where dmtd::attend is not built) → [B, nh·hd]."""
    if one or shared:
        keys = kc[s0: s0 + 1, :, :read_len]
        vals = vc[s0: s0 + 1, :, :read_len]
    elif contiguous:
        keys = kc[s0: s0 + B, :, :read_len]
        vals = vc[s0: s0 + B, :, :read_len]
    else:
        keys = kc[:, :, :read_len].index_select(0, slots)
        vals = vc[:, :, :read_len].index_select(0, slots)
    if shared and row_loop >= B:
        # Row by row over its own keys, with exactly the ops of a one-row step at that position: no mask,
        # no key copy (a broadcast over the rows would copy the keys once per row), and the same value a
        # step of this row alone computes.
        qs = q.reshape(B, nkv, g, hd).to(keys.dtype)
        outs: List[torch.Tensor] = []  # noqa: UP006
        for b in range(B):
            n = read_len - B + 1 + b
            s = torch.matmul(qs[b: b + 1], keys[:, :, :n].transpose(-1, -2)) * scale
            outs.append(torch.matmul(torch.softmax(s, -1), vals[:, :, :n]))
        return torch.cat(outs, 0).reshape(B, nkv * g * hd)
    s = torch.matmul(q.reshape(B, nkv, g, hd).to(keys.dtype), keys.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask.logical_not().view(B, 1, 1, read_len), float("-inf"))
    return torch.matmul(torch.softmax(s, -1), vals).reshape(B, nkv * g * hd)


def _decode_layers(
    h: torch.Tensor,  # [B, H]
    ln1: List[torch.Tensor], qkv: List[torch.Tensor], qkv_bias: Optional[List[torch.Tensor]],  # noqa: UP006, UP045
    q_norm: Optional[List[torch.Tensor]], k_norm: Optional[List[torch.Tensor]],  # noqa: UP006, UP045
    o: List[torch.Tensor], ln2: List[torch.Tensor], gate_up: List[torch.Tensor],  # noqa: UP006, UP045
    down: List[torch.Tensor], kc: List[torch.Tensor], vc: List[torch.Tensor],  # noqa: UP006, UP045
    cos: torch.Tensor, sin: torch.Tensor,  # [B, hd] (sin is the signed table)
    slots: torch.Tensor, pos: torch.Tensor,  # [B] int64
    slot_lo: int, contiguous: bool, read_len: int, mask: Optional[torch.Tensor],  # noqa: UP045 — [B, read_len] bool
    nh: int, nkv: int, hd: int, eps: float, shared: bool = False,  # shared: every row is a position of slot_lo
    mode: int = 0,  # 0: dense input-major weights; else packed (dmtd.engine.lowbit) with these scales:
    s_qkv: Optional[List[torch.Tensor]] = None, s_o: Optional[List[torch.Tensor]] = None,  # noqa: UP006, UP045
    s_gu: Optional[List[torch.Tensor]] = None, s_down: Optional[List[torch.Tensor]] = None,  # noqa: UP006, UP045
    row_loop: int = 8,  # shared chunks of up to this many rows attend row by row
    attend: bool = False,  # attention by dmtd::attend (kernels/attend.h): every row alone, one call a layer
) -> torch.Tensor:
    B = h.shape[0]
    g = nh // nkv
    half = hd // 2
    inter = gate_up[0].shape[0] // 2 if mode != 0 else down[0].shape[0]
    scale = hd ** -0.5
    cos3 = cos.unsqueeze(1)
    sin3 = sin.unsqueeze(1)
    one = B == 1
    s0 = slot_lo
    p0 = read_len - 1
    # dmtd::attend's rows: each reads keys 0 .. its own position of its own slot
    if one:
        att_slots = torch.full([1], s0, dtype=torch.long)
        att_lens = torch.full([1], read_len, dtype=torch.long)
    elif shared:
        att_slots = torch.full([B], s0, dtype=torch.long)
        att_lens = torch.arange(read_len - B + 1, read_len + 1, dtype=torch.long)
    else:
        att_slots = slots
        att_lens = pos + 1
    for i in range(len(ln1)):
        y = _lin(_rms(h, ln1[i], eps), qkv[i], s_qkv, i, mode)
        if qkv_bias is not None:
            y = y + qkv_bias[i]
        y = y.view(B, nh + 2 * nkv, hd)
        qk = y[:, : nh + nkv]
        v = y[:, nh + nkv:]
        if q_norm is not None and k_norm is not None:
            qk = torch.cat((_rms(qk[:, :nh], q_norm[i], eps), _rms(qk[:, nh:], k_norm[i], eps)), dim=1)
        qk = qk * cos3 + qk.view(B, nh + nkv, 2, half).flip(2).reshape(B, nh + nkv, hd) * sin3
        q = qk[:, :nh]
        k = qk[:, nh:].to(kc[i].dtype)
        v = v.to(kc[i].dtype)
        if one:
            kc[i][s0, :, p0] = k[0]
            vc[i][s0, :, p0] = v[0]
        elif shared:  # consecutive positions p0 - B + 1 .. p0 of one sequence (a verify or draft chunk)
            kc[i][s0, :, p0 - B + 1: p0 + 1] = k.transpose(0, 1)
            vc[i][s0, :, p0 - B + 1: p0 + 1] = v.transpose(0, 1)
        else:
            kc[i][slots, :, pos] = k
            vc[i][slots, :, pos] = v
        if attend:  # reads the cache itself
            a = torch.ops.dmtd.attend(q, kc[i], vc[i], att_slots, att_lens, scale).to(h.dtype)
        else:
            a = _torch_attention(q, kc[i], vc[i], slots, s0, B, one, shared, contiguous, read_len, mask, nkv, g, hd,
                                 scale, row_loop).to(h.dtype)
        h = h + _lin(a, o[i], s_o, i, mode)
        gu = _lin(_rms(h, ln2[i], eps), gate_up[i], s_gu, i, mode)
        h = h + _lin(F.silu(gu[:, :inter]) * gu[:, inter:], down[i], s_down, i, mode)
    return h


# torch.jit is deprecated in favour of torch.compile, but inductor's CPU code for these tiny shapes
# measured slower than eager here, while TorchScript's interpreter removes the Python overhead.
decode_layers: Any
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    decode_layers = torch.jit.script(_decode_layers)
