"""The trainable DMTD student over a base model, and the frozen base model as its teacher.

Both run the engine's own functional layer (:func:`dmtd.engine.model.layer_forward`) and routing
(:func:`dmtd.engine.model.route_decoding_input`). Layers below the first trainable one are frozen and
identical for student and teacher, so they run once, under ``no_grad``, and are shared; with the
decoding layers as the only trainable scope that is the whole trunk.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from dmtd.engine.config import DMTDConfig
from dmtd.engine.model import LayerWeights, Transformer, layer_forward, route_decoding_input
from dmtd.train.lora import LoRAAdapters

Scope = Literal["decoding", "all", "lora"]
NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def run(ws: list[LayerWeights], model: Transformer, h: torch.Tensor, lo: int, hi: int, cos: torch.Tensor,
        sin: torch.Tensor) -> torch.Tensor:
    for i in range(lo, hi):
        h = layer_forward(ws[i], model.config, h, cos, sin)
    return h


def _frozen_copy(w: LayerWeights) -> LayerWeights:
    return LayerWeights._make(None if t is None else t.detach().clone() for t in w)


class DMTDStudent(nn.Module):
    """Trainable parameters (whole layers or LoRA adapters + norms) and the forward passes that use them."""

    def __init__(self, model: Transformer, dmtd: DMTDConfig, scope: Scope, lora: LoRAAdapters | None = None,
                 lora_train_norms: bool = True) -> None:
        super().__init__()
        dmtd.check_model(model.config)
        if (scope == "lora") != (lora is not None):
            raise ValueError("scope 'lora' needs adapters, and only it")
        self.model, self.dmtd, self.scope = model, dmtd, scope
        self.lora = lora
        model.requires_grad_(False)
        L = model.config.num_layers
        full = list(range(dmtd.decoding_start, L)) if scope == "decoding" else list(range(L)) if scope == "all" else []
        for i in full:
            model.layers[i].requires_grad_(True)
        norm_layers = lora.layers if lora is not None and lora_train_norms else []
        for i in norm_layers:
            for n, p in model.layers[i].named_parameters():
                if n.rsplit(".", 1)[0] in NORMS:
                    p.requires_grad_(True)
        touched = full or (lora.layers if lora is not None else [])
        self.first_trainable = min(touched)
        model._weights = None  # noqa: SLF001 - rebuild the gathered tuples over the live parameters
        base = model.layer_weights()
        # The teacher keeps a frozen copy of every layer whose tensors training changes in place.
        changed = set(full) | set(norm_layers)
        self.teacher_ws = [_frozen_copy(w) if i in changed else w for i, w in enumerate(base)]

    def named_trainable(self) -> dict[str, torch.Tensor]:
        """Trainable tensors by stable name (model parameter names; ``lora.a.*`` / ``lora.b.*`` for adapters)."""
        out = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if self.lora is not None:
            out.update({f"lora.{n}": p for n, p in self.lora.named_parameters()})
        return dict(sorted(out.items()))

    def student_ws(self) -> list[LayerWeights]:
        ws = list(self.model.layer_weights())
        if self.lora is not None:
            for i in self.lora.layers:
                w = ws[i]
                ws[i] = w._replace(**{t: self.lora.merged(i, t, getattr(w, t)) for t in self.lora.targets})
        return ws

    def forward_pair(self, input_ids: torch.Tensor, head_mask: torch.Tensor,
                     select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Student logits under DMTD routing (with grad) and base-model logits (no grad).

        ``select`` [B, T] bool picks the positions whose logits are computed (both → [N, V]); None = all.
        """
        m, d = self.model, self.dmtd
        E, ds, L, f = d.thinking_start, d.decoding_start, m.config.num_layers, self.first_trainable
        cos, sin = m.rope(torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0))
        tw = self.teacher_ws
        cuts = sorted({0, E, min(f, ds), ds})
        with torch.no_grad():
            hs = {0: m.embed_tokens(input_ids)}
            for a, b in zip(cuts, cuts[1:]):
                hs[b] = run(tw, m, hs[a], a, b, cos, sin)
            h_t = run(tw, m, hs[ds], ds, L, cos, sin)
            logits_t = m.logits(h_t if select is None else h_t[select])
        sw = self.student_ws()
        if f >= ds:
            h_enc, h_think = hs[E], hs[ds]
        elif f >= E:
            h_enc, h_think = hs[E], run(sw, m, hs[f], f, ds, cos, sin)
        else:
            h_enc = run(sw, m, hs[f], f, E, cos, sin)
            h_think = run(sw, m, h_enc, E, ds, cos, sin)
        x = route_decoding_input(h_enc, h_think, head_mask, d.head_input)
        h = run(sw, m, x, ds, L, cos, sin)
        return m.logits(h if select is None else h[select]), logits_t

    @torch.no_grad()
    def masked_logits(self, input_ids: torch.Tensor, head_mask: torch.Tensor) -> torch.Tensor:
        """The trainer's masked forward over whole sequences: logits [B, T, V] (for parity checks and eval)."""
        return self.forward_pair(input_ids, head_mask)[0]

    @torch.no_grad()
    def merged_state(self) -> dict[str, torch.Tensor]:
        """The tensors a variant replaces in the base model: trained layers / norms, adapters merged."""
        out = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        if self.lora is not None:
            sd = self.model.state_dict()
            for i in self.lora.layers:
                for t in self.lora.targets:
                    name = self.lora.weight_name(i, t)
                    out[name] = self.lora.merged(i, t, sd[name]).detach()
        return out
