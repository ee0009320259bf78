"""Tiny models and corpora for the training tests (random weights, written by transformers itself)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.train.config import TrainConfig
from dmtd.train.corpus import CorpusConfig, CorpusManifest
from dmtd.train.datagen import make_corpus
from dmtd.train.prompts import prompts_hash
from dmtd.variants.loader import load_model
from dmtd.variants.manifest import base_fingerprint

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def save_tiny(path: Path, seed: int = 0, with_tokenizer: bool = False, **kw: object) -> Path:
    """A tiny random Llama directory; ``with_tokenizer`` copies SmolLM2's tokenizer (vocab 49152)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {**TINY, **kw}
    if with_tokenizer:
        extra["vocab_size"] = 49152
    cfg = AutoConfig.for_model("llama", **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        from dmtd.variants.smollm2 import smollm2_dir

        src = smollm2_dir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (src / f).is_file():
                shutil.copy(src / f, path / f)
    return path


def tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def corpus_config(model_dir: Path, prompts: list, **kw: object) -> CorpusConfig:
    base = dict(base_model=str(model_dir), base_fingerprint=base_fingerprint(model_dir),
                prompts_sha256=prompts_hash(prompts), num_prompts=len(prompts), samples_per_prompt=2,
                temperatures=[0.0, 1.0], top_p=0.95, max_new_tokens=20, seed=0, held_out_fraction=0.2,
                shard_size=6, batch_size=4)
    base.update(kw)
    return CorpusConfig(**base)  # type: ignore[arg-type]


def tiny_corpus(model_dir: Path, out: Path, n_prompts: int = 12, **kw: object) -> CorpusManifest:
    loaded = load_model(model_dir, tokenizer=False)
    engine = LLMEngine(loaded.model, None, DMTDConfig.plain(6, 1), EngineConfig(max_num_seqs=4, max_model_len=128),
                       default_tau=1, eos_token_ids=[])
    prompts = tiny_prompts(n_prompts)
    return make_corpus(out, engine, prompts, corpus_config(model_dir, prompts, **kw), progress=False)


def train_config(model_dir: Path, corpus: Path, **kw: object) -> TrainConfig:
    base = dict(name="tiny", corpus=str(corpus), base_model=str(model_dir), num_decoding_layers=2, tau_min=2,
                tau_max=4, lr=3e-3, warmup_steps=2, max_steps=6, batch_size=3, grad_accum=2, max_len=64,
                checkpoint_every=2, keep_checkpoints=5)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def tiny_cache(model_dir: Path, corpus: Path, top_k: int = 97, hidden_dtype: str = "float32",
               num_decoding_layers: int = 2, num_encoding_layers: int = 0, out: Path | None = None,
               temperatures: tuple[float, ...] | None = None) -> Path:
    """A teacher cache of a tiny corpus (by default exact: every token id, fp32 states)."""
    from dmtd.train.cache import CacheSpec, build_cache
    from dmtd.train.student import DMTDStudent
    from dmtd.train.trainer import dmtd_of_split

    loaded = load_model(model_dir, tokenizer=False)
    d = dmtd_of_split(num_encoding_layers, num_decoding_layers, loaded.config.num_layers)
    spec = CacheSpec(num_encoding_layers, num_decoding_layers, top_k, hidden_dtype,  # type: ignore[arg-type]
                     temperatures)
    return build_cache(corpus, DMTDStudent(loaded.model, d, "decoding"), spec, base_fingerprint(model_dir), out,
                       progress=False)
