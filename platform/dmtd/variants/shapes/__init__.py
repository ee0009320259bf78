"""Model shapes without weights: the presets (the architecture facts of the models people serve, from their
``config.json``) and the folders ``dmtd shapes export`` writes, which this engine (``--load-format dummy``) and vLLM
(``--load-format dummy``) both run from the same files.

A folder holds the shape's ``config.json`` and a tokenizer that covers its whole vocabulary: the shipped SmolLM2
tokenizer (49,152 entries) with placeholder tokens ``<|shape_N|>`` appended to ``vocab_size``, so that every id a
random-weight model samples decodes. The special tokens (BOS, EOS, the chat template) are SmolLM2's: ``config.json``
names their ids in place of the original model's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmtd.engine.config import ConfigError, ModelConfig

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PLACEHOLDER = "<|shape_{}|>"


@dataclass(slots=True, frozen=True)
class Shape:
    """A preset: its name, where its facts come from, the DMTD split its benchmarks use, its ``config.json``."""

    name: str
    source: str
    decoding_layers: int
    config: dict[str, Any]

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.config)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset(name: str) -> Shape:
    """The preset ``name``; :class:`ConfigError` listing the presets if there is none."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"shape {name!r} is not a preset (presets: {', '.join(preset_names())})")
    raw = json.loads(path.read_text())
    return Shape(raw["name"], raw["source"], int(raw["decoding_layers"]), raw["config"])


def extended_tokenizer(src: Path, vocab_size: int, chat_template: bool = True) -> dict[str, str]:
    """The files of ``src``'s tokenizer (a byte-level BPE ``tokenizer.json``) with placeholders appended to its
    vocabulary up to ``vocab_size`` entries: file name → text. Without ``chat_template``, the tokenizer has none."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    used = {int(t["id"]) for t in tok.get("added_tokens", [])} | set(vocab.values())
    if max(used) >= vocab_size:
        raise ConfigError(f"vocab_size {vocab_size} is smaller than the tokenizer's {max(used) + 1} ids")
    for i in range(len(vocab), vocab_size):
        if i not in used:
            vocab[PLACEHOLDER.format(i)] = i
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("backend", "is_local", "local_files_only", "chat_template")}
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5 (and so vLLM) load it
    files = {"tokenizer.json": json.dumps(tok, ensure_ascii=False)}
    template = src / "chat_template.jinja"
    if chat_template and template.is_file():
        cfg["chat_template"] = template.read_text()  # inline as well: older transformers read it there only
        files["chat_template.jinja"] = template.read_text()
    files["tokenizer_config.json"] = json.dumps(cfg, indent=1)
    files["special_tokens_map.json"] = json.dumps({k: cfg[k] for k in ("bos_token", "eos_token", "pad_token",
                                                                      "unk_token") if k in cfg}, indent=1)
    return files


def export_shape(shape: Shape | dict[str, Any], out: Path, tokenizer_src: Path | None = None,
                 chat_template: bool = True) -> Path:
    """Write a shape's folder (config, tokenizer, generation config; no weights) at ``out``, atomically.

    ``shape``: a preset or a ``config.json`` dict; ``tokenizer_src``: a model folder whose tokenizer is extended
    (default: the shipped SmolLM2's)."""
    from dmtd.variants.smollm2 import smollm2_dir

    config = dict(shape.config if isinstance(shape, Shape) else shape)
    ModelConfig.from_hf(config)  # an unsupported or malformed config fails here, naming its field
    src = tokenizer_src or smollm2_dir()
    base = json.loads((src / "config.json").read_text())
    files = extended_tokenizer(src, int(config["vocab_size"]), chat_template)
    special = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if base.get(k) is not None}
    config.update(special)
    if isinstance(shape, Shape):
        config["dmtd_shape"] = {"name": shape.name, "source": shape.source, "decoding_layers": shape.decoding_layers,
                                "tokenizer": f"{src.name}'s, placeholders {PLACEHOLDER.format('N')} to vocab_size; "
                                             "special token ids are its own"}
    files["config.json"] = json.dumps(config, indent=1)
    files["generation_config.json"] = json.dumps(special, indent=1)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and "dmtd_shape" not in _config_of(out):
        raise ConfigError(f"{str(out)!r} exists and is not a shape folder: name a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is read by other users (a vLLM container)
    try:
        for name, text in files.items():
            (tmp / name).write_text(text + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _config_of(folder: Path) -> dict[str, Any]:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
