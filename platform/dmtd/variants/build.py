"""Build an engine for a base model or a variant (the one place the CLI, trainer and servers do it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.variants.loader import LoadedModel, load_model
from dmtd.variants.manifest import MANIFEST_NAME, ManifestError, VariantManifest, read_manifest, sha256_file

BASE_TAU_MAX = 8


@dataclass(slots=True)
class EngineSpec:
    """What to run: a model, its routing and the default cycle settings."""

    loaded: LoadedModel
    dmtd: DMTDConfig
    default_tau: int
    min_confidence: float
    variant: VariantManifest | None


def find_variant(name_or_path: str, search_dirs: list[Path] | None = None) -> Path:
    """A manifest path from a path or a variant name (looked up under the shipped variants dir)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    for d in search_dirs or []:
        cand = d / name_or_path / MANIFEST_NAME
        if cand.is_file():
            return cand
    raise ManifestError(f"variant {name_or_path!r} not found (not a path, not a shipped variant)")


def apply_variant_weights(loaded: LoadedModel, manifest: VariantManifest, root: Path) -> None:
    """Check the manifest fits the base model and load the variant's trained tensors over it."""
    dmtd = manifest.dmtd_config()
    try:
        dmtd.check_model(loaded.config)
    except ConfigError as e:
        raise ManifestError(f"variant {manifest.name!r} does not fit base model {loaded.path}: {e}") from e
    if manifest.weights is None:
        return
    wpath = root / manifest.weights
    if not wpath.is_file():
        raise ManifestError(f"variant {manifest.name!r}: weights file {str(wpath)!r} not found")
    digest = sha256_file(wpath)
    if digest != manifest.weights_sha256:
        raise ManifestError(f"variant {manifest.name!r}: weights checksum mismatch "
                            f"(manifest {manifest.weights_sha256}, file {digest})")
    tensors = load_file(str(wpath))
    own = loaded.model.state_dict()
    for k, t in tensors.items():
        if k not in own:
            raise ManifestError(f"variant {manifest.name!r}: tensor {k!r} does not exist in the base model")
        if tuple(t.shape) != tuple(own[k].shape):
            raise ManifestError(f"variant {manifest.name!r}: tensor {k!r} has shape {tuple(t.shape)}, "
                                f"the base model's is {tuple(own[k].shape)}")
    with torch.no_grad():
        for k, t in tensors.items():
            own[k].copy_(t.to(own[k].dtype))


def engine_spec(model: str | None = None, variant: str | None = None, decoding_layers: int | None = None,
                dtype: torch.dtype = torch.float32, device: str = "cpu",
                search_dirs: list[Path] | None = None) -> EngineSpec:
    """Resolve ``--model`` / ``--variant`` / ``--decoding-layers`` into a loaded model and routing."""
    if variant not in (None, "none"):
        mpath = find_variant(variant, search_dirs)
        manifest = read_manifest(mpath)
        root = mpath if mpath.is_dir() else mpath.parent
        loaded = load_model(model or manifest.base_model, dtype=dtype, device=device)
        apply_variant_weights(loaded, manifest, root)
        return EngineSpec(loaded, manifest.dmtd_config(), manifest.default_tau, manifest.min_confidence, manifest)
    loaded = load_model(model, dtype=dtype, device=device)
    if loaded.dmtd is not None and decoding_layers is None:
        return EngineSpec(loaded, loaded.dmtd, loaded.dmtd.tau_max, 0.0, None)
    L = loaded.config.num_layers
    dmtd = DMTDConfig.plain(L, decoding_layers or 1, BASE_TAU_MAX if decoding_layers else 1)
    return EngineSpec(loaded, dmtd, 1, 0.0, None)


def build_engine(spec: EngineSpec, cfg: EngineConfig | None = None) -> LLMEngine:
    return LLMEngine(spec.loaded.model, spec.loaded.tokenizer, spec.dmtd, cfg, default_cycle_len=spec.default_tau)
