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

    def _frozen(self, input_ids: torch.Tensor, select: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The teacher's pass: hidden states at the group cuts (shared with the student) and its logits."""
        m, d = self.model, self.dmtd
        E, ds, L, f = d.thinking_start, d.decoding_start, m.config.num_layers, self.first_trainable
        tw = self.teacher_ws
        cuts = sorted({0, E, min(f, ds), ds})
        with torch.no_grad():
            hs = {0: m.embed_tokens(input_ids)}
            for a, b in zip(cuts, cuts[1:]):
                hs[b] = run(tw, m, hs[a], a, b, cos, sin)
            h_t = run(tw, m, hs[ds], ds, L, cos, sin)
            return hs, m.logits(h_t if select is None else h_t[select])

    def _rope(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rope(torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0))

    @property
    def trunk_frozen(self) -> bool:
        """True when nothing below the decoding layers trains: their inputs do not depend on the weights."""
        return self.first_trainable >= self.dmtd.decoding_start

    @torch.no_grad()
    def frozen_pass(self, input_ids: torch.Tensor,
                    select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """With a frozen trunk: the decoding layers' inputs ``h_enc``, ``h_think`` [B, T, H] and the base
        model's logits at ``select`` — everything :meth:`decode` needs besides the trained weights."""
        if not self.trunk_frozen:
            raise ValueError("frozen_pass needs a frozen trunk (only decoding layers train)")
        d = self.dmtd
        hs, logits_t = self._frozen(input_ids, select, *self._rope(input_ids))
        return hs[d.thinking_start], hs[d.decoding_start], logits_t

    def decode(self, h_enc: torch.Tensor, h_think: torch.Tensor, head_mask: torch.Tensor,
               select: torch.Tensor | None = None, ws: list[LayerWeights] | None = None) -> torch.Tensor:
        """Student logits from the decoding layers' inputs under DMTD routing (with grad); ``select`` as in
        :meth:`forward_pair`; ``ws`` the student's layer weights when already gathered. With a frozen
        trunk these inputs can come from a cache."""
        h = self._decoding_layers(h_enc, h_think, head_mask, ws)
        return self.model.logits(h if select is None else h[select])

    def decode_hidden(self, h_enc: torch.Tensor, h_think: torch.Tensor, head_mask: torch.Tensor,
                      select: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`decode` up to the final norm: the hidden states the head reads [N, H] (with grad)."""
        h = self._decoding_layers(h_enc, h_think, head_mask)
        return self.model.norm.forward(h if select is None else h[select])

    def _decoding_layers(self, h_enc: torch.Tensor, h_think: torch.Tensor, head_mask: torch.Tensor,
                         ws: list[LayerWeights] | None = None) -> torch.Tensor:
        m, d = self.model, self.dmtd
        cos, sin = m.rope(torch.arange(h_enc.shape[1], device=h_enc.device).unsqueeze(0))
        x = route_decoding_input(h_enc, h_think, head_mask, d.head_input)
        return run(ws or self.student_ws(), m, x, d.decoding_start, m.config.num_layers, cos, sin)

    @property
    def head_weight(self) -> torch.Tensor:
        """The frozen lm_head as [V, H] (the tied embeddings, or the untied head's transpose)."""
        m = self.model
        return m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight.t()

    def forward_pair(self, input_ids: torch.Tensor, head_mask: torch.Tensor,
                     select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Student logits under DMTD routing (with grad) and base-model logits (no grad).

        ``select`` [B, T] bool picks the positions whose logits are computed (both → [N, V]); None = all.
        """
        m, d = self.model, self.dmtd
        E, ds, f = d.thinking_start, d.decoding_start, self.first_trainable
        cos, sin = self._rope(input_ids)
        hs, logits_t = self._frozen(input_ids, select, cos, sin)
        sw = self.student_ws()
        if f >= ds:
            h_enc, h_think = hs[E], hs[ds]
        elif f >= E:
            h_enc, h_think = hs[E], run(sw, m, hs[f], f, ds, cos, sin)
        else:
            h_enc = run(sw, m, hs[f], f, E, cos, sin)
            h_think = run(sw, m, h_enc, E, ds, cos, sin)
        return self.decode(h_enc, h_think, head_mask, select, sw), logits_t

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
