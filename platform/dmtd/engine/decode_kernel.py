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
from dmtd.engine.kv_cache import gather_pages


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _lin(x: torch.Tensor, w: torch.Tensor, s: Optional[List[torch.Tensor]], i: int, mode: int  # noqa: UP006, UP045
         ) -> torch.Tensor:
    """``x @ w`` for a dense input-major weight (mode 0), else the packed weight's kernel with scales ``s[i]``."""
    if mode == 0 or s is None:
        return torch.mm(x, w)
    return torch.ops.dmtd.linear(x, w, s[i], mode)


def _torch_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, kv_rows: torch.Tensor,
                     B: int, one: bool, shared: bool, read_len: int, mask: Optional[torch.Tensor],  # noqa: UP045
                     nkv: int, g: int, hd: int, scale: float, row_loop: int) -> torch.Tensor:
    """The decode rows' attention with torch's ops (where dmtd::attend is not built) → [B, nh·hd]."""
    rows = kv_rows[:1] if one or shared else kv_rows
    keys = gather_pages(kc, table, rows, read_len)
    vals = gather_pages(vc, table, rows, read_len)
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
    kv_rows: torch.Tensor, pos: torch.Tensor,  # [B] int64: each row's sequence (its page-table row) and position
    table: torch.Tensor,  # [sequences, pages] int64: the pages of each sequence's positions (dmtd.engine.kv_cache)
    read_len: int, mask: Optional[torch.Tensor],  # noqa: UP045 — [B, read_len] bool
    nh: int, nkv: int, hd: int, eps: float, shared: bool = False,  # shared: the rows are positions of one sequence
    mode: int = 0,  # 0: dense input-major weights; else packed (dmtd.engine.lowbit) with these scales:
    s_qkv: Optional[List[torch.Tensor]] = None, s_o: Optional[List[torch.Tensor]] = None,  # noqa: UP006, UP045
    s_gu: Optional[List[torch.Tensor]] = None, s_down: Optional[List[torch.Tensor]] = None,  # noqa: UP006, UP045
    row_loop: int = 8,  # shared chunks of up to this many rows attend row by row
    attend: bool = False,  # attention by dmtd::attend (kernels/attend.h): every row alone, one call a layer
) -> torch.Tensor:
    B = h.shape[0]
    g = nh // nkv
    half = hd // 2
    scale = hd ** -0.5
    cos3 = cos.unsqueeze(1)
    sin3 = sin.unsqueeze(1)
    one = B == 1
    # dmtd::attend's rows: each reads keys 0 .. its own position of its own sequence
    att_lens = torch.full([1], read_len, dtype=torch.long) if one else pos + 1
    P = kc[0].shape[2]
    w_page = table[kv_rows, torch.div(pos, P, rounding_mode="floor")]
    w_off = torch.remainder(pos, P)
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
        kc[i][w_page, :, w_off] = k
        vc[i][w_page, :, w_off] = v
        if attend:  # reads the cache itself
            a = torch.ops.dmtd.attend(q, kc[i], vc[i], table, kv_rows, att_lens, scale).to(h.dtype)
        else:
            a = _torch_attention(q, kc[i], vc[i], table, kv_rows, B, one, shared, read_len, mask, nkv, g, hd,
                                 scale, row_loop).to(h.dtype)
        h = h + _lin(a, o[i], s_o, i, mode)
        gu = _lin(_rms(h, ln2[i], eps), gate_up[i], s_gu, i, mode)
        inter = gu.shape[-1] // 2  # from the product: a packed weight's own shape is its format's (blocked bf16)
        h = h + _lin(F.silu(gu[:, :inter]) * gu[:, inter:], down[i], s_down, i, mode)
    return h


# torch.jit is deprecated in favour of torch.compile, but inductor's CPU code for these tiny shapes
# measured slower than eager here, while TorchScript's interpreter removes the Python overhead.
decode_layers: Any
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    decode_layers = torch.jit.script(_decode_layers)
