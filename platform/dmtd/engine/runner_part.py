"""What the runner's parts (:mod:`dmtd.engine.prefill`, :mod:`dmtd.engine.verified_passes`) use of the runner: its
model, weights, caches and contexts, declared once; :class:`dmtd.engine.runner.ModelRunner` sets and defines them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dmtd.engine.config import DMTDConfig, EngineConfig
    from dmtd.engine.kv_cache import KVCache
    from dmtd.engine.model import LayerWeights, StepContext, Transformer
    from dmtd.engine.verifier import Verifier


class RunnerPart:
    """A mixin of the runner."""

    model: Transformer
    dmtd: DMTDConfig
    cfg: EngineConfig
    device: torch.device
    act_dtype: torch.dtype
    weights: list[LayerWeights]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    cache: KVCache
    verifier: Verifier
    verify_weights: list[LayerWeights]
    verify_kv: list[tuple[torch.Tensor, torch.Tensor]] | None

    if TYPE_CHECKING:  # the runner's own
        def logits(self, h: torch.Tensor) -> torch.Tensor: ...
        def enable_exact(self) -> None: ...
        def _context(self, kv_rows: list[int], positions: torch.Tensor, valid: torch.Tensor | None) -> StepContext: ...
