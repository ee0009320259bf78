"""What the drafts run on: the tail path's layers and the head's columns of the draft vocabulary, in the drafts' format
(packed for speed once the verifying path is on: the verifier checks every draft, so their precision changes
acceptance, never the output), and the unverified profile's tail head."""

from __future__ import annotations

import torch

from dmtd.engine import lowbit
from dmtd.engine.model import LayerWeights
from dmtd.engine.model_state import ModelState


class DraftWeights:
    """The draft vocabulary (FR-Spec: drafts score only ``ids``; verification keeps the full vocabulary) and the
    weights of draft passes, built from the engine's (``state``) on first use."""

    def __init__(self, state: ModelState, draft_format: str | None) -> None:
        self.state = state
        self.ids: torch.Tensor | None = None  # restricted tail vocabulary (None = the full one)
        self.id_set: set[int] | None = None
        self.pass_ids: torch.Tensor | None = None  # the last draft pass's columns: ids + its sequences' context ids
        # the context ids last added (sorted), ids + them, and their head columns [H, E]: rebuilt only when the ids
        # change (a request's context gains a new word every few cycles, not every pass)
        self.context_head: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None
        self._draft_head: torch.Tensor | lowbit.PackedWeight | None = None
        self._tail_head: torch.Tensor | lowbit.PackedWeight | None = None  # the head's draft-vocabulary columns
        self.format = draft_format  # set by enable(): None where the drafts run on the engine's weights
        self.layers: list[LayerWeights] = state.weights
        # dmtd::draft_layers' per-layer arguments gathered by column, per layer group (start, end): one sequence
        self.fused: dict[tuple[int, int], tuple[int, list[list[torch.Tensor]]]] | None = None
        # the same for the other variants of the trunk (ModelState.tails), made on first use
        self._variant_layers: dict[str, list[LayerWeights]] = {}
        self._variant_fused: dict[str, dict[tuple[int, int], tuple[int, list[list[torch.Tensor]]]]] = {}

    def enable(self) -> None:
        """The drafts' own packed layers (first use of verified cycles), where their format fits the model."""
        st, d, fmt = self.state, self.state.dmtd, self.format
        dense = st.model.layer_weights()
        if fmt is not None and lowbit.fits(dense, fmt):
            self.layers = (lowbit.pack_layers(dense[: d.thinking_start], fmt)
                           + st.weights[d.thinking_start: d.decoding_start]
                           + lowbit.pack_layers(dense[d.decoding_start:], fmt))
            self._draft_head = None
            groups = [(0, d.thinking_start), (d.decoding_start, d.num_layers)]
            fused = {g: st.model.rows_args(self.layers, st.kv, *g) for g in groups if g[0] < g[1]}
            self.fused = None if None in fused.values() else fused  # type: ignore[assignment]
        else:
            self.format = None

    def layers_for(self, variant: str) -> list[LayerWeights]:
        """The draft passes' layers of ``variant``'s sequences (``""``: the engine's own): the shared encoding and
        thinking groups, then its decoding group in the drafts' format."""
        st = self.state
        if not variant:
            return self.layers
        if self.layers is st.weights:
            return st.weights_of(variant)
        got = self._variant_layers.get(variant)
        if got is None:
            ds = st.dmtd.decoding_start
            assert self.format is not None
            got = self.layers[:ds] + lowbit.pack_layers(st.tails[variant][ds:], self.format)
            self._variant_layers[variant] = got
        return got

    def fused_for(self, variant: str) -> dict[tuple[int, int], tuple[int, list[list[torch.Tensor]]]] | None:
        """``fused`` for ``variant``'s sequences (None where the draft passes do not run fused)."""
        if self.fused is None or not variant:
            return self.fused
        got = self._variant_fused.get(variant)
        if got is None:
            st, d = self.state, self.state.dmtd
            group = st.model.rows_args(self.layers_for(variant), st.kv, d.decoding_start, d.num_layers)
            if group is None:
                return None
            got = {**self.fused, (d.decoding_start, d.num_layers): group}
            self._variant_fused[variant] = got
        return got

    def forget(self, variant: str) -> list[list[LayerWeights]]:
        """Drop ``variant``'s draft layers; returns the lists dropped (their rows-op arguments go with them)."""
        self._variant_fused.pop(variant, None)
        got = self._variant_layers.pop(variant, None)
        return [] if got is None else [got]

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Drafts score only ``ids`` (FR-Spec); verification keeps the full vocabulary."""
        self.ids, self._draft_head = (None, None) if ids is None else (ids.to(self.state.device), None)
        self._tail_head = None
        self.id_set = None if ids is None else set(ids.tolist())
        self.context_head = None

    def draft_head(self) -> torch.Tensor | lowbit.PackedWeight:
        """The drafts' head ``[H, N]``: the lm_head's columns of the draft vocabulary in the drafts' format (packed
        for speed once the verifying path is on: the verifier checks every draft), copied once."""
        if self._draft_head is None:
            if self.format is not None and self.layers is not self.state.weights:
                m = self.state.model
                dense = m.lm_head.weight if m.lm_head is not None else m.lm_head_t  # [H, V]
                assert dense is not None
                cols = dense if self.ids is None else dense[:, self.ids]
                self._draft_head = lowbit.pack(cols.t(), self.format)
            else:
                self._draft_head = self.tail_head()
        return self._draft_head

    def tail_head(self) -> torch.Tensor | lowbit.PackedWeight:
        """The unverified profile's tail head ``[H, N]``: the engine's own lm_head, its columns of the draft
        vocabulary — never the drafts' packed copy, so a tail token is the same whether or not an exact request ever
        switched the verifying path on."""
        if self._tail_head is None:
            full, ids = self.state.head, self.ids
            if ids is None:
                self._tail_head = full
            elif isinstance(full, lowbit.PackedWeight):
                self._tail_head = full.rows(ids)
            else:
                self._tail_head = full[:, ids].contiguous()
        return self._tail_head

    def bytes_share(self) -> float:
        """Weight bytes a draft pass reads (the tail path's layers in the drafts' format, the draft head) ÷ those a
        plain step reads (every layer, the whole lm_head): what a tail costs where weight reads set the pace."""
        d, st = self.state.dmtd, self.state
        tail = self.layers[: d.thinking_start] + self.layers[d.decoding_start:]
        return ((_layer_bytes(tail) + weight_bytes(self.draft_head()))
                / (_layer_bytes(st.weights) + weight_bytes(st.head)))


def weight_bytes(w: object) -> int:
    """Bytes a layer tensor or head holds (dense, or packed with its scales)."""
    if isinstance(w, lowbit.PackedWeight):
        return w.data.numel() * w.data.element_size() + w.scales.numel() * w.scales.element_size()
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0


def _layer_bytes(layers: list[LayerWeights]) -> int:
    return sum(weight_bytes(t) for lw in layers for t in lw)
