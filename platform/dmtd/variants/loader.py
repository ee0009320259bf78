"""Offline model loading: the embedded SmolLM2 default, Hugging Face directories, authors' DMTD checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dmtd.engine.config import ConfigError, DMTDConfig, ModelConfig
from dmtd.engine.model import Transformer
from dmtd.variants.smollm2 import ModelNotFoundError, smollm2_dir

DEFAULT_MODEL = "smollm2"
# vLLM's spellings: "auto" reads the folder's safetensors, "dummy" builds seeded random weights (dmtd.variants.dummy)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
LOAD_FORMAT_ENV = "DMTD_LOAD_FORMAT"  # a serving stack's fallback (dmtd serve --load-format sets it for its replicas)
# config fields whose other values the engine does not compute (model_type is checked by ModelConfig.from_hf)
SUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "hidden_act": ("silu",), "mlp_bias": (False,), "use_sliding_window": (False,),
}


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the engine, with what its checkpoint said about DMTD routing (if anything)."""

    path: Path
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    dmtd: DMTDConfig | None  # set for checkpoints in the authors' DMTD format


def resolve_model_path(model: str | Path | None) -> Path:
    """``None`` / ``"smollm2"`` → the converted embedded default; otherwise a local directory."""
    if model is None or str(model) in (DEFAULT_MODEL, "default"):
        return smollm2_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model path {str(path)!r} has no config.json")
    return path


def read_config(path: Path) -> dict[str, Any]:
    """A model folder's ``config.json``, checked for what the engine computes: a field it does not names itself."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path / 'config.json'} must hold a JSON object")
    for name, served in SUPPORTED_FIELDS.items():
        if name in raw and raw[name] not in served:
            raise ConfigError(f"{path / 'config.json'}: {name} {raw[name]!r} is not supported (supported: "
                              f"{', '.join(repr(v) for v in served)})")
    return raw


def authors_dmtd_config(raw: dict[str, Any], tau_max: int | None = None) -> DMTDConfig | None:
    """Routing from the authors' config fields (``num_*_layers``, ``mtp_horizon``), if present."""
    keys = ("num_encoding_layers", "num_thinking_layers", "num_decoding_layers")
    if not any(k in raw for k in keys):
        return None
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ConfigError(f"DMTD checkpoint config lacks {', '.join(missing)}")
    horizon = int(raw.get("mtp_horizon", tau_max or 4))
    # The authors' training code anchors cycles at absolute positions and adds the thinking output.
    return DMTDConfig(int(raw["num_encoding_layers"]), int(raw["num_thinking_layers"]),
                      int(raw["num_decoding_layers"]), tau_max or horizon, "absolute", "residual_add")


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def load_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               rope_len: int | None = None, tokenizer: bool = True, load_format: str = "auto",
               seed: int = 0) -> LoadedModel:
    """Load a Llama / Qwen2 / Qwen3 / DMTD model directory (or the embedded default) offline.

    ``load_format`` ``"dummy"``: the folder's config and tokenizer only, weights seeded random
    (:mod:`dmtd.variants.dummy`, ``seed``), built in ``dtype``. A model that does not fit memory is refused first.
    """
    from dmtd.variants.memory import check_fits, model_bytes

    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    path = resolve_model_path(model)
    raw = read_config(path)
    cfg = ModelConfig.from_hf(raw)
    dmtd = authors_dmtd_config(raw)
    if dmtd is not None:
        dmtd.check_model(cfg)
    rope_len = rope_len or min(cfg.max_position_embeddings, 8192)
    if load_format == "dummy":
        from dmtd.variants.dummy import dummy_model

        net = dummy_model(cfg, dtype, device, seed, rope_len)
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"model path {str(path)!r} has no *.safetensors weights (--load-format dummy "
                                     "runs its config with random weights)")
        # read on the host in float32, then cast and moved: the files and the float32 model at once there
        check_fits("the model's weights (read in float32)", model_bytes(cfg, torch.float32)
                   + sum(f.stat().st_size for f in files), "cpu")
        if torch.device(device).type != "cpu":
            check_fits("the model's weights", model_bytes(cfg, dtype), device)
        net = Transformer(cfg, rope_len=rope_len)
        net.load_hf_state_dict(load_state_dict(path))
        net = net.to(device=device, dtype=dtype).eval()
    net.requires_grad_(False)
    tok = load_tokenizer(path) if tokenizer else None
    return LoadedModel(path, net, tok, cfg, dmtd)
