"""A variant's tails for an engine that already runs its trunk: the decoding group of another variant of the same base
and layer split, built from the base model's own files and the variant's (its tensors, its adapter merged, in float32
and then cast, exactly as a whole load of it does: dmtd.variants.build), without loading the model again. The engine
serves it beside its own (``LLMEngine.add_variant``); a variant whose trunk differs is refused, naming what differs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dmtd.engine.config import DMTDConfig, ModelConfig
from dmtd.engine.hf_names import fused_layer
from dmtd.engine.model import LayerWeights
from dmtd.variants.build import LORA_A, LORA_B, checked_file, find_variant, merge_lora, read_adapter
from dmtd.variants.manifest import ManifestError, VariantManifest, base_fingerprint, read_manifest

TRUNK_FIELDS = ("num_decoding_layers", "num_encoding_layers", "num_thinking_layers", "phase_anchor", "head_input")


@dataclass(slots=True)
class Trunk:
    """What the variants one engine serves share: the base model's folder, config and fingerprint, the layer split."""

    path: Path
    config: ModelConfig
    dmtd: DMTDConfig
    fingerprint: str

    def key(self) -> str:
        """The trunk's identity (the prefix cache's and the registry's key for sharing): base and split."""
        d = self.dmtd
        return f"{self.fingerprint[:16]}:e{d.num_encoding_layers}t{d.num_thinking_layers}d{d.num_decoding_layers}"


@dataclass(slots=True)
class LoadedTails:
    """A variant's decoding group, ready for ``LLMEngine.add_variant``."""

    manifest: VariantManifest
    layers: list[LayerWeights]
    load_s: float


def check_shares_trunk(trunk: Trunk, manifest: VariantManifest) -> None:
    """Raise :class:`ManifestError` naming the field unless ``manifest`` runs ``trunk`` (same base, same split and
    routing, only its decoding group changed, so its exact profile verifies with the base)."""
    mine = manifest.dmtd_config()
    for name in TRUNK_FIELDS:
        got, want = getattr(mine, name), getattr(trunk.dmtd, name)
        if got != want:
            raise ManifestError(f"variant {manifest.name!r}: {name} is {got!r}, the replica's trunk has {want!r} "
                                "(variants of one replica share the base model's layer split)")
    if manifest.vocab_size is not None and manifest.vocab_size != trunk.config.vocab_size:
        raise ManifestError(f"variant {manifest.name!r}: vocab_size {manifest.vocab_size}, the base model's is "
                            f"{trunk.config.vocab_size}")
    if manifest.base_fingerprint is not None and manifest.base_fingerprint != trunk.fingerprint:
        raise ManifestError(f"variant {manifest.name!r}: base_fingerprint {manifest.base_fingerprint[:16]}… is not "
                            f"the replica's base ({trunk.fingerprint[:16]}…)")
    if manifest.verifier == "variant":
        raise ManifestError(f"variant {manifest.name!r}: verifier 'variant' (it changes more than its decoding "
                            "group): it cannot share another variant's trunk")


def load_tails(trunk: Trunk, variant: str | Path, dtype: torch.dtype, search_dirs: list[Path] | None = None,
               ) -> LoadedTails:
    """The decoding group of ``variant`` (a manifest path or folder, or a shipped name) over ``trunk``'s base, in
    ``dtype``; files checked against their SHA-256, every tensor it changes inside the decoding group."""
    t0 = time.perf_counter()
    mpath = find_variant(str(variant), search_dirs)
    manifest = read_manifest(mpath)
    root = mpath if mpath.is_dir() else mpath.parent
    check_shares_trunk(trunk, manifest)
    d = trunk.dmtd
    own = _base_decoding_group(trunk)
    if manifest.weights is not None:
        path = checked_file(manifest, root, manifest.weights, manifest.weights_sha256, "weights")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ManifestError(f"variant {manifest.name!r}: weights {str(path)!r} is not a safetensors file: {e}") \
                from e
        for k, t in tensors.items():
            _check_tensor(manifest, own, k, tuple(t.shape), "weights")
            own[k].copy_(t.to(own[k].dtype))
    if manifest.adapter is not None:
        path = checked_file(manifest, root, manifest.adapter, manifest.adapter_sha256, "adapter")
        tensors, meta = read_adapter(path)
        if meta.get("base_fingerprint") != trunk.fingerprint:
            raise ManifestError(f"variant {manifest.name!r}: adapter {str(path)!r} was made for another base model")
        try:
            scale = float(meta["alpha"]) / float(meta["rank"])
        except (KeyError, ValueError) as e:
            raise ManifestError(f"adapter {str(path)!r}: metadata lacks a numeric alpha and rank") from e
        for name in sorted(k[: -len(LORA_A)] for k in tensors if k.endswith(LORA_A)):
            a, b = tensors[name + LORA_A], tensors.get(name + LORA_B)
            if b is None:
                raise ManifestError(f"adapter {str(path)!r}: {name!r} lacks its B matrix")
            _check_tensor(manifest, own, name, (a.shape[0], b.shape[1]), "adapter")
            w = own[name]
            w.copy_(merge_lora(w, a.to(w.dtype), b.to(w.dtype), scale))
    layers = [_layer_weights(own, f"layers.{i}.", dtype) for i in range(d.decoding_start, d.num_layers)]
    return LoadedTails(manifest, layers, time.perf_counter() - t0)


def _layer_weights(own: dict[str, torch.Tensor], p: str, dtype: torch.dtype) -> LayerWeights:
    def get(name: str) -> torch.Tensor | None:
        got = own.get(p + name)
        return None if got is None else got.to(dtype)

    def need(name: str) -> torch.Tensor:
        got = get(name)
        assert got is not None, f"{p}{name} is a tensor of every layer"
        return got

    return LayerWeights(need("input_layernorm.weight"), need("self_attn.qkv_proj.weight"),
                        get("self_attn.qkv_proj.bias"), get("self_attn.q_norm.weight"), get("self_attn.k_norm.weight"),
                        need("self_attn.o_proj.weight"), need("post_attention_layernorm.weight"),
                        need("mlp.gate_up_proj.weight"), need("mlp.down_proj.weight"))


def _check_tensor(manifest: VariantManifest, own: dict[str, torch.Tensor], name: str, shape: tuple[int, ...],
                  what: str) -> None:
    if name not in own:
        raise ManifestError(f"variant {manifest.name!r}: {what} changes {name!r}, which is not a tensor of the "
                            "decoding group: its trunk differs from the base's")
    if tuple(own[name].shape) != shape:
        raise ManifestError(f"variant {manifest.name!r}: {what} tensor {name!r} has shape {shape}, the base's is "
                            f"{tuple(own[name].shape)}")


def _base_decoding_group(trunk: Trunk) -> dict[str, torch.Tensor]:
    """The base model's decoding-group tensors in float32 under the engine's names, read from its safetensors."""
    files = sorted(trunk.path.glob("*.safetensors"))
    wanted = [f"layers.{i}." for i in range(trunk.dmtd.decoding_start, trunk.dmtd.num_layers)]
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no iterator
                if any(w in k for w in wanted):
                    sd[k.removeprefix("model.")] = st.get_tensor(k).float()
    own: dict[str, torch.Tensor] = {}
    for i in range(trunk.dmtd.decoding_start, trunk.dmtd.num_layers):
        try:
            own.update(fused_layer(trunk.config, sd.__getitem__, i))
        except KeyError as e:
            raise ManifestError(f"base model {str(trunk.path)!r} lacks tensor {e.args[0]!r}") from e
    return {k: v.contiguous() for k, v in own.items()}


def trunk_of(path: Path, config: ModelConfig, dmtd: DMTDConfig) -> Trunk:
    """The trunk of an engine over the base model at ``path`` (its fingerprint cached: dmtd.variants.manifest)."""
    return Trunk(path, config, dmtd, base_fingerprint(path))
