"""What a replica builds its engine from: the variant to load and the typed engine settings
(``dmtd_contract.serve_config.EngineSettings``). Picklable, plain settings only: ``build_app`` makes one per
variant, and the replica calls it inside its own process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dmtd.serve.controller import ControllerConfig
from dmtd_contract.serve_config import EngineSettings

if TYPE_CHECKING:  # torch loads in the replica's process only, when it builds
    from dmtd.engine.llm import LLMEngine


@dataclass(slots=True)
class EngineBuilder:
    """Builds a replica's engine and its τ controller's config (``DMTDReplica``'s ``engine_factory``)."""

    variant: str = "none"
    model: str | None = None
    decoding_layers: int | None = None
    tau_max: int | None = None  # a cap on the variant's own
    torch_threads: int = 0  # 0: env DMTD_TORCH_THREADS, else every core
    load_format: str | None = None  # None: env DMTD_LOAD_FORMAT, else "auto" (dmtd.variants.loader.LOAD_FORMATS)
    settings: EngineSettings = field(default_factory=EngineSettings)
    # set by the call: what other variants of the built engine share (dmtd.variants.tails.Trunk; None where the model
    # has no files to build tails from, e.g. dummy weights)
    trunk: Any = None

    def __call__(self) -> tuple[LLMEngine, ControllerConfig]:
        import torch

        from dmtd.engine.config import EngineConfig
        from dmtd.variants.build import build_engine, engine_spec, variant_precision
        from dmtd.variants.loader import LOAD_FORMAT_ENV
        from dmtd.variants.paths import SHIPPED_VARIANTS

        s = self.settings
        torch.set_num_threads(self.torch_threads or int(os.environ.get("DMTD_TORCH_THREADS", "0"))
                              or os.cpu_count() or 1)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype, quant = variant_precision(self.variant, s.dtype, s.quant, device)
        load_format = self.load_format or os.environ.get(LOAD_FORMAT_ENV, "") or "auto"
        spec = engine_spec(self.model, self.variant, self.decoding_layers, dtype=getattr(torch, dtype), device=device,
                           search_dirs=[SHIPPED_VARIANTS], load_format=load_format)
        engine = build_engine(spec, EngineConfig(max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len,
                                                 kv_cache_tokens=s.pool_tokens(), kv_cache_gib=s.kv_cache_gib,
                                                 kv_cache_dtype=s.kv_cache_dtype,
                                                 device=device, dtype=dtype, quant=quant,
                                                 adaptive_drafts=s.drafts == "adaptive",
                                                 context_drafts=s.context_drafts, phrase_drafts=s.phrase_drafts,
                                                 prefill_pace=s.prefill_pace,
                                                 long_prefill_tokens=s.long_prefill_tokens))
        if load_format != "dummy":
            from dmtd.variants.tails import trunk_of

            self.trunk = trunk_of(spec.loaded.path, spec.loaded.config, spec.dmtd)
        tau_max = min(self.tau_max or spec.dmtd.tau_max, spec.dmtd.tau_max)
        cfg = ControllerConfig(tau_min=1, tau_max=tau_max, rest_tau=min(spec.default_tau, tau_max),
                               rest_min_confidence=spec.min_confidence, itl_slo_ms=s.itl_slo_ms,
                               max_batch=s.max_num_seqs,
                               default_profile=spec.variant.default_profile if spec.variant is not None else "dmtd")
        return engine, cfg
