"""Shared fixtures: tiny random-weight models for mechanics, the real SmolLM2 for model behaviour."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from dmtd.engine.config import DMTDConfig, EngineConfig, ModelConfig  # noqa: E402
from dmtd.engine.llm import LLMEngine  # noqa: E402
from dmtd.engine.model import Transformer  # noqa: E402


def tiny_config(**kw: object) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, tie_word_embeddings=True, eos_token_ids=[])
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **kw: object) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(tiny_config(**kw))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() > 1 and "embed" not in name:
                p.normal_(0, 0.2)
            elif "bias" in name:
                p.normal_(0, 0.1)
    return m.eval().requires_grad_(False)


def tiny_engine(model: Transformer, dmtd: DMTDConfig, max_num_seqs: int = 8, max_model_len: int = 256,
                dtype: str = "float32", align_phases: bool = True) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype, align_phases=align_phases)
    return LLMEngine(model, None, dmtd, cfg, default_tau=1, eos_token_ids=[])


@pytest.fixture(scope="session")
def smollm2():
    from dmtd.variants.loader import load_model

    return load_model()
