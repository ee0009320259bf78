"""The verifying path of verified cycles: whose next-token predictions check the tails' drafts.

A head of a verified cycle runs the whole stack with the verifier's decoding-group weights and routing,
over the previous cycle's tail positions plus itself, so its logits are the verifier's own prediction at
every one of them. The verifier is

* ``base`` — the base model, when the variant carries the base weights and changes only the decoding
  group (adapters and decoding-scope weights, like ours): the output is the base model's;
* ``variant`` — otherwise (e.g. a fully fine-tuned DMTD checkpoint): the variant's own τ = 1 path,
  every position a head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmtd.engine.config import ConfigError, DMTDConfig, HeadInput
from dmtd.engine.model import LayerWeights, Transformer


@dataclass(slots=True)
class Verifier:
    """Decoding-group weights and head routing of the verifying path."""

    name: str  # "base" or "variant"
    head_input: HeadInput
    layers: list[LayerWeights] | None = None  # decoding group; None = the model's own

    def weights(self, model: Transformer, dmtd: DMTDConfig) -> list[LayerWeights]:
        """Per-layer weights of the verifying path (encoding and thinking groups are shared)."""
        own = model.layer_weights()
        if self.layers is None:
            return own
        if len(self.layers) != dmtd.num_decoding_layers:
            raise ConfigError(f"verifier holds {len(self.layers)} decoding layers, the variant has "
                              f"{dmtd.num_decoding_layers}")
        return own[: dmtd.decoding_start] + self.layers


def own_verifier(dmtd: DMTDConfig, is_base: bool) -> Verifier:
    """The model verifies itself: the base model exactly if it is one, else the variant's τ = 1 path."""
    return Verifier("base" if is_base and dmtd.head_input == "replace" else "variant",
                    "replace" if is_base else dmtd.head_input)


def snapshot_decoding_layers(model: Transformer, dmtd: DMTDConfig) -> list[LayerWeights]:
    """Copies of the decoding group's weights, taken before a variant's tensors are merged over them."""
    out = []
    for w in model.layer_weights()[dmtd.decoding_start:]:
        out.append(LayerWeights._make(None if t is None else t.detach().clone() for t in w))
    return out


def check_draft_vocab(ids: list[int], vocab_size: int, eos_ids: set[int]) -> torch.Tensor:
    """A restricted tail vocabulary: distinct ids in range that include every EOS id."""
    if not ids:
        raise ConfigError("draft_vocab must hold at least one token id")
    if len(set(ids)) != len(ids):
        raise ConfigError("draft_vocab token ids must be distinct")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ConfigError(f"draft_vocab token ids must be in 0..{vocab_size - 1}")
    missing = sorted(eos_ids - set(ids))
    if missing:
        raise ConfigError(f"draft_vocab lacks the EOS token id(s) {missing}: a draft could never end the text")
    return torch.tensor(ids, dtype=torch.long)
