"""Engine τ=1 greedy equals HF transformers ``generate`` greedy on the real SmolLM2 (fp32)."""

from __future__ import annotations

import pytest
import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams

PROMPTS = [
    "The history of the printing press",
    "def quicksort(arr):",
    "Here is a list of five fruits:",
    "Once upon a time in a small village,",
    "The three laws of thermodynamics are",
    "Photosynthesis is the process by which",
]


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def test_tau1_equals_hf_generate(smollm2, hf_model):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, tau_max=4),
                       EngineConfig(max_num_seqs=8, max_model_len=256))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=64, tau=1, ignore_eos=True))
    for res in results:
        ids = torch.tensor([res.prompt_token_ids])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                    do_sample=False, pad_token_id=0)
        expected = out[0, ids.shape[1]:].tolist()
        assert len(expected) == 64
        assert res.token_ids == expected
        assert all(res.head_flags) and res.mean_block_len == 1.0
    assert engine.scheduler.num_free_kv_rows == 8


def test_chat_template_and_text(smollm2):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, tau_max=4),
                       EngineConfig(max_num_seqs=2, max_model_len=512))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    res = engine.generate([msgs], SamplingParams(max_new_tokens=32, tau=1))[0]
    assert res.prompt_token_ids[:1] == smollm2.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert "Paris" in res.text
    assert res.finish_reason == "stop"  # ended on <|im_end|>
    assert res.text == smollm2.tokenizer.decode(res.token_ids, skip_special_tokens=True)
