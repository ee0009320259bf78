"""Offline loading of Llama / Qwen2 / Qwen3 HF directories and the DMTD authors' checkpoint format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.loader import load_model
from dmtd.variants.smollm2 import ModelNotFoundError

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def save_hf(tmp: Path, kind: str, **extra) -> Path:
    """A tiny random model written by transformers itself, as a user's local checkpoint would be."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **{**COMMON, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp, safe_serialization=True)
    return tmp


@pytest.mark.parametrize("kind,extra", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 16}),
    ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
])
def test_lean_model_matches_transformers(tmp_path, kind, extra):
    from transformers import AutoModelForCausalLM

    path = save_hf(tmp_path, kind, **extra)
    ours = load_model(path, tokenizer=False)
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    dmtd = DMTDConfig.plain(4, 1)
    with torch.no_grad():
        a = ours.model.forward_masked(ids, torch.ones_like(ids, dtype=torch.bool), dmtd)
        b = theirs(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and incremental decoding through the engine equals HF greedy
    engine = LLMEngine(ours.model, None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=128),
                       eos_token_ids=[])
    res = engine.generate([ids[0, :12].tolist()], SamplingParams(max_new_tokens=16, tau=1))[0]
    theirs.generation_config.eos_token_id = None
    out = theirs.generate(ids[:1, :12], attention_mask=torch.ones_like(ids[:1, :12]), max_new_tokens=16,
                          do_sample=False, pad_token_id=0)
    assert res.token_ids == out[0, 12:].tolist()


def write_authors_checkpoint(tmp: Path) -> Path:
    """A tiny random DMTD checkpoint in the authors' format: Qwen3 config + DMTD fields, HF tensor names."""
    path = save_hf(tmp, "qwen3", head_dim=16)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update({"architectures": ["MTPQwen3ForCausalLM"], "model_type": "mtpqwen3",
                "num_encoding_layers": 1, "num_thinking_layers": 2, "num_decoding_layers": 1,
                "mtp_horizon": 3})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_authors_dmtd_checkpoint_loads_and_runs(tmp_path):
    path = write_authors_checkpoint(tmp_path)
    lm = load_model(path, tokenizer=False)
    assert lm.dmtd is not None
    assert (lm.dmtd.num_encoding_layers, lm.dmtd.num_thinking_layers, lm.dmtd.num_decoding_layers) == (1, 2, 1)
    assert lm.dmtd.tau_max == 3 and lm.dmtd.phase_anchor == "absolute" and lm.dmtd.head_input == "residual_add"
    engine = LLMEngine(lm.model, None, lm.dmtd, EngineConfig(max_num_seqs=2, max_model_len=64), eos_token_ids=[])
    res = engine.generate([list(range(1, 9))], SamplingParams(max_new_tokens=12, tau=3))[0]
    assert len(res.token_ids) == 12
    assert res.head_flags == [p % 3 == 0 for p in range(7, 19)]
    ids = torch.tensor([list(range(1, 9)) + res.token_ids[:-1]])
    mask = torch.tensor([[p % 3 == 0 for p in range(ids.shape[1])]])
    with torch.no_grad():
        ref = lm.model.forward_masked(ids, mask, lm.dmtd)[0, 7:].argmax(-1).tolist()
    assert ref == res.token_ids


def test_authors_checkpoint_with_wrong_split_is_rejected(tmp_path):
    path = write_authors_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_thinking_layers"] = 5
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model(path, tokenizer=False)


def test_unknown_model_path_names_it(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


def test_missing_tensor_and_unsupported_family(tmp_path):
    path = save_hf(tmp_path / "m", "llama")
    sd = {"model.embed_tokens.weight": torch.zeros(101, 64)}
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing tensor"):
        load_model(path, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type"):
        load_model(path, tokenizer=False)


@pytest.mark.slow
def test_conversion_gives_the_tokenizer_the_models_eos(smollm2):
    """transformers 5.17 read the GGUF's EOS as <|im_start|>; conversion takes the config's ids instead."""
    from transformers import AutoConfig, AutoTokenizer

    from dmtd.variants.smollm2 import align_special_tokens

    config = AutoConfig.from_pretrained(str(smollm2.path))
    tok = AutoTokenizer.from_pretrained(str(smollm2.path))
    tok.eos_token, tok.bos_token = tok.bos_token, tok.eos_token  # what 5.17's GGUF reader gave, and worse
    assert tok.eos_token_id != config.eos_token_id
    align_special_tokens(tok, config)
    assert (tok.eos_token_id, tok.bos_token_id) == (config.eos_token_id, config.bos_token_id)
    assert tok.eos_token_id in smollm2.config.eos_token_ids
