"""CUDA: the same engine on the GPU gives the CPU's greedy tokens (skipped where no GPU exists)."""

from __future__ import annotations

import pytest
import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tau", [1, 3])
def test_cuda_matches_cpu(tau):
    dmtd = DMTDConfig(1, 3, 2, tau_max=4, head_input="residual_add")
    prompts = [[1, 2, 3, 4], list(range(10, 30))]
    params = SamplingParams(max_new_tokens=24, cycle_len=tau)
    cpu = LLMEngine(tiny_model(seed=9), None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128),
                    eos_token_ids=[]).generate(prompts, params)
    gpu_model = tiny_model(seed=9).to("cuda")
    gpu = LLMEngine(gpu_model, None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128, device="cuda"),
                    eos_token_ids=[]).generate(prompts, params)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
    sampled = LLMEngine(gpu_model, None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128, device="cuda"),
                        eos_token_ids=[]).generate(prompts, SamplingParams(temperature=1.0, seed=1, max_new_tokens=8))
    assert all(len(r.token_ids) == 8 for r in sampled)
