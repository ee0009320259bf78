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
    params = SamplingParams(max_new_tokens=24, tau=tau)
    cpu = LLMEngine(tiny_model(seed=9), None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128),
                    eos_token_ids=[]).generate(prompts, params)
    gpu_model = tiny_model(seed=9).to("cuda")
    gpu = LLMEngine(gpu_model, None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128, device="cuda"),
                    eos_token_ids=[]).generate(prompts, params)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
    sampled = LLMEngine(gpu_model, None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128, device="cuda"),
                        eos_token_ids=[]).generate(prompts, SamplingParams(temperature=1.0, seed=1, max_new_tokens=8))
    assert all(len(r.token_ids) == 8 for r in sampled)


def test_the_shipped_variant_loads_onto_the_gpu_as_on_the_cpu():
    """A variant's adapter merges into a model on the GPU (training there starts from it) to the CPU's tensors."""
    from dmtd.variants.build import apply_variant_weights
    from dmtd.variants.loader import load_model
    from dmtd.variants.manifest import read_manifest
    from dmtd.variants.paths import SHIPPED_VARIANTS

    root = SHIPPED_VARIANTS / "smollm2-135m-dmtd"
    manifest = read_manifest(root)
    cpu, gpu = load_model(None, tokenizer=False), load_model(None, device="cuda", tokenizer=False)
    assert apply_variant_weights(cpu, manifest, root) == apply_variant_weights(gpu, manifest, root)
    for (name, a), (_, b) in zip(cpu.model.named_parameters(), gpu.model.named_parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5, msg=name)
