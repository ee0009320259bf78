"""The variant manifest: what a DMTD variant is (user-facing, pydantic)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dmtd.engine.config import DMTDConfig

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
    phase_anchor: Literal["prompt_end", "absolute"] = "prompt_end"
    head_input: Literal["residual_add", "replace"] = "replace"
    description: str = ""

    @model_validator(mode="after")
    def _tau_in_range(self) -> VariantManifest:
        if self.default_tau > self.tau_max:
            raise ValueError(f"default_tau ({self.default_tau}) must be <= tau_max ({self.tau_max})")
        if (self.weights is None) != (self.weights_sha256 is None):
            raise ValueError("weights and weights_sha256 must be given together")
        return self

    def dmtd_config(self) -> DMTDConfig:
        return DMTDConfig(self.num_encoding_layers, self.num_thinking_layers, self.num_decoding_layers,
                          self.tau_max, self.phase_anchor, self.head_input)


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
