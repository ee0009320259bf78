"""The variant manifest: what a DMTD variant is (user-facing, pydantic)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dmtd.engine.config import DMTDConfig
from dmtd_contract.variant_schema import DefaultProfile, HeadInput, PhaseAnchor, VerifierName

MANIFEST_NAME = "variant.json"


class ManifestError(ValueError):
    """A manifest is missing, malformed, or does not fit its base model."""


class VariantManifest(BaseModel):
    """A DMTD variant: a base model, a layer split, routing conventions and (optionally) trained weights."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Variant name (registry key)", pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    base_model: str = Field("smollm2", description="Base model: 'smollm2' or a local HF directory")
    weights: str | None = Field(None, description="safetensors file with the trained tensors, relative to "
                                "the manifest; None = the base weights unchanged")
    weights_sha256: str | None = Field(None, description="SHA-256 of the weights file")
    num_encoding_layers: int = Field(0, ge=0)
    num_thinking_layers: int = Field(ge=1)
    num_decoding_layers: int = Field(ge=1)
    tau_max: int = Field(4, ge=1, le=16, description="Largest cycle length the variant serves")
    default_tau: int = Field(3, ge=1, description="τ used when a request does not ask")
    min_confidence: float = Field(0.0, ge=0.0, le=1.0, description="Default confidence gate")
    draft_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="exact profile: stop drafting at a draft whose top-1 probability is "
        "below this (None = min_confidence); with adaptive drafts the measured acceptance and pass costs decide "
        "the rest")
    phase_anchor: PhaseAnchor = "prompt_end"
    head_input: HeadInput = "replace"
    description: str = ""
    base_fingerprint: str | None = Field(None, description="SHA-256 over the base model's tensors "
                                         "(dmtd.variants.manifest.base_fingerprint); None = not checked")
    vocab_size: int | None = Field(None, ge=1, description="the base model's vocabulary size; None = not checked")
    adapter: str | None = Field(None, description="safetensors file of LoRA adapters (format dmtd-lora-v1), "
                                "merged into the base weights at load, relative to the manifest")
    adapter_sha256: str | None = Field(None, description="SHA-256 of the adapter file")
    recipe: dict[str, Any] | None = Field(None, description="the training config that made the variant")
    data_hash: str | None = Field(None, description="content hash of the training corpus")
    eval: dict[str, Any] | None = Field(None, description="headline results of `dmtd eval` on the variant")
    heldout: str | None = Field(None, description="JSONL sample of the corpus's held-out records (prompt and "
                                "base completion ids), relative to the manifest, so `dmtd eval` runs anywhere")
    default_profile: DefaultProfile = Field(
        "dmtd", description="cycle profile a request gets when it names none: 'dmtd' (gated tails emit their "
        "tokens) or 'exact' (verified cycles: tails are drafts, the output is the verifier's)")
    verifier: VerifierName | None = Field(
        None, description="what the exact profile's output equals: 'base' (the base model; the variant changes "
        "only the decoding group and carries the base weights) or 'variant' (its own τ = 1 path); None = derived "
        "at load, checked when given")
    draft_vocab: str | None = Field(None, description="safetensors file (tensor token_ids) of the restricted tail "
                                    "vocabulary, relative to the manifest; None = the full vocabulary")
    draft_vocab_sha256: str | None = Field(None, description="SHA-256 of the draft_vocab file")
    phrase_table: str | None = Field(None, description="safetensors file of the phrase table (the corpus answers' "
                                     "next token after 3-token contexts: drafts of greedy exact requests), "
                                     "relative to the manifest; None = no table")
    phrase_table_sha256: str | None = Field(None, description="SHA-256 of the phrase_table file")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="recommended precision: 'auto' = bfloat16 on a CPU with AVX-512 or AVX2, else float32")
    quant: Literal["none", "int8", "int4"] = Field("none", description="recommended weight-only quantisation")

    @model_validator(mode="after")
    def _tau_in_range(self) -> VariantManifest:
        if self.default_tau > self.tau_max:
            raise ValueError(f"default_tau ({self.default_tau}) must be <= tau_max ({self.tau_max})")
        if (self.weights is None) != (self.weights_sha256 is None):
            raise ValueError("weights and weights_sha256 must be given together")
        if (self.adapter is None) != (self.adapter_sha256 is None):
            raise ValueError("adapter and adapter_sha256 must be given together")
        if (self.draft_vocab is None) != (self.draft_vocab_sha256 is None):
            raise ValueError("draft_vocab and draft_vocab_sha256 must be given together")
        if (self.phrase_table is None) != (self.phrase_table_sha256 is None):
            raise ValueError("phrase_table and phrase_table_sha256 must be given together")
        return self

    def dmtd_config(self) -> DMTDConfig:
        return DMTDConfig(self.num_encoding_layers, self.num_thinking_layers, self.num_decoding_layers,
                          self.tau_max, self.phase_anchor, self.head_input)

    def exact_draft_threshold(self) -> float:
        """The exact profile's default draft stop: ``draft_threshold``, else ``min_confidence``."""
        return self.min_confidence if self.draft_threshold is None else self.draft_threshold


def base_fingerprint(model_dir: Path) -> str:
    """SHA-256 over a model directory's tensors (names, dtypes, shapes, bytes), independent of file metadata.

    Cached under the dmtd cache keyed by file path, size and mtime (hashing SmolLM2 takes ~2 s).
    """
    import torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ManifestError(f"{model_dir}: no *.safetensors files to fingerprint")
    key = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    cache = _fingerprint_cache()
    try:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
    except (OSError, json.JSONDecodeError):
        known = {}
    if key in known:
        return str(known[key])
    h = hashlib.sha256()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name).contiguous()
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()
    known[key] = digest
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest


def _fingerprint_cache() -> Path:
    return Path(os.environ.get("DMTD_CACHE", Path.home() / ".cache" / "dmtd")) / "fingerprints.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> VariantManifest:
    """Parse a manifest file (or a directory holding ``variant.json``), naming the failing field."""
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"variant manifest {str(path)!r} not found")
    try:
        return VariantManifest.model_validate(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from e
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "manifest"
        raise ManifestError(f"{path}: {loc}: {first['msg']}") from e


def update_manifest(mpath: Path, manifest: VariantManifest, **fields: Any) -> VariantManifest:
    """``manifest`` with ``fields`` set, validated, then written over ``mpath`` atomically (never half-written)."""
    data = manifest.model_dump(mode="json", exclude_none=True)
    data.update(fields)
    new = VariantManifest.model_validate(data)
    tmp = mpath.with_name(f".{mpath.name}.{os.getpid()}")
    tmp.write_text(json.dumps(new.model_dump(mode="json", exclude_none=True), indent=1) + "\n")
    os.replace(tmp, mpath)
    return new
