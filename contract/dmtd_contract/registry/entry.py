"""A registry entry: one model variant, what it is (``VariantSpec``) and how it is served (``VariantEntry``).

The fields mirror ``dmtd.variants.manifest.VariantManifest`` (the registry stays independent of the variants
package and so of torch); ``VariantSpec.from_manifest`` takes a manifest object or its JSON dict, and
``to_manifest_dict`` gives back a dict that ``VariantManifest.model_validate`` accepts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dmtd_contract.registry.errors import InvalidVariant
from dmtd_contract.variant_schema import (
    DefaultProfile,
    HeadInput,
    PhaseAnchor,
    VariantStatus,
    VerifierName,
    changed_tensors,
    verifier_of,
)

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"

# The manifest's fields the registry keeps, by manifest name -> registry name.
_MANIFEST_FIELDS = {
    "name": "name", "base_model": "base_model", "weights": "weights_uri", "weights_sha256": "weights_sha256",
    "adapter": "adapter_uri", "adapter_sha256": "adapter_sha256", "num_encoding_layers": "num_encoding_layers",
    "num_thinking_layers": "num_thinking_layers", "num_decoding_layers": "num_decoding_layers",
    "tau_max": "tau_max", "default_tau": "default_tau", "min_confidence": "min_confidence",
    "phase_anchor": "phase_anchor", "head_input": "head_input", "description": "description",
    "default_profile": "default_profile", "verifier": "verifier",
}
_MAX_HEADER_BYTES = 100 << 20
_LOCATIONS = ("weights", "adapter")

M = TypeVar("M", bound=BaseModel)


class VariantSpec(BaseModel):
    """What a variant is: its base model, trained files, layer split, τ range and routing conventions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Variant name, the registry key", pattern=NAME_PATTERN)
    base_model: str = Field("smollm2", min_length=1, description="Base model: 'smollm2' or a local HF directory")
    manifest_uri: str | None = Field(None, description="Where the variant's manifest (variant.json) lives, "
                                     "path or URI; replicas load the variant from it")
    weights_uri: str | None = Field(None, description="Trained tensors (safetensors), path or URI; "
                                    "None = the base weights unchanged")
    weights_sha256: str | None = Field(None, pattern=SHA256_PATTERN, description="SHA-256 of the weights file")
    adapter_uri: str | None = Field(None, description="LoRA adapter file (dmtd-lora-v1), path or URI")
    adapter_sha256: str | None = Field(None, pattern=SHA256_PATTERN, description="SHA-256 of the adapter file")
    num_encoding_layers: int = Field(0, ge=0, description="E: layers every position runs first")
    num_thinking_layers: int = Field(ge=1, description="T: layers only head positions run")
    num_decoding_layers: int = Field(ge=1, description="D: layers every position runs last")
    tau_min: int = Field(1, ge=1, le=16, description="Smallest cycle length τ a replica may choose")
    tau_max: int = Field(4, ge=1, le=16, description="Largest cycle length τ the variant serves")
    default_tau: int = Field(3, ge=1, le=16, description="τ used when neither request nor controller decides")
    min_confidence: float = Field(0.0, ge=0.0, le=1.0, description="Default confidence gate: a tail token "
                                  "whose top-1 probability is below it ends the cycle")
    phase_anchor: PhaseAnchor = Field("prompt_end", description="Where cycles start: 'prompt_end' or 'absolute'")
    head_input: HeadInput = Field("replace", description="Decoding input at heads: 'residual_add' or 'replace'")
    description: str = Field("", description="Free text shown by `dmtd variants show`")
    default_profile: DefaultProfile = Field(
        "dmtd", description="Cycle profile of a request that names none: 'dmtd' (gated tails emit their tokens; "
        "the replica's controller sets τ and the gate) or 'exact' (verified cycles: the output is the verifier's)")
    verifier: VerifierName | None = Field(
        None, description="What the exact profile's output equals: 'base' (the base model) or 'variant' (the "
        "variant's own τ = 1 path); None = not known at registration (the variant's files were not readable)")

    @model_validator(mode="after")
    def _check_rules(self) -> VariantSpec:
        if self.tau_min > self.tau_max:
            raise InvalidVariant("tau_min", f"must be <= tau_max ({self.tau_max}), got {self.tau_min}")
        if not self.tau_min <= self.default_tau <= self.tau_max:
            raise InvalidVariant("default_tau", f"must lie in [tau_min, tau_max] = [{self.tau_min}, "
                                 f"{self.tau_max}], got {self.default_tau}")
        for kind in _LOCATIONS:
            uri, sha = getattr(self, f"{kind}_uri"), getattr(self, f"{kind}_sha256")
            if (uri is None) != (sha is None):
                missing = f"{kind}_sha256" if sha is None else f"{kind}_uri"
                raise InvalidVariant(missing, f"{kind}_uri and {kind}_sha256 must be given together")
        return self

    @classmethod
    def from_manifest(cls, manifest: Any, manifest_path: str | Path | None = None, **overrides: Any) -> VariantSpec:
        """Build a spec from a ``VariantManifest`` (or its JSON dict, or any object with its attributes).

        ``manifest_path`` is the manifest file; relative weight/adapter locations are resolved against its
        folder, as the manifest defines them. ``overrides`` set registry-only fields such as ``tau_min``.
        """
        data = _as_dict(manifest)
        spec: dict[str, Any] = {ours: data[theirs] for theirs, ours in _MANIFEST_FIELDS.items() if theirs in data}
        if manifest_path is not None:
            folder = Path(manifest_path).resolve().parent
            spec["manifest_uri"] = str(Path(manifest_path).resolve())
            for kind in _LOCATIONS:
                loc = spec.get(f"{kind}_uri")
                if isinstance(loc, str) and "://" not in loc:
                    spec[f"{kind}_uri"] = str(folder / loc)
        spec.update(overrides)
        if spec.get("verifier") is None:
            spec["verifier"] = _derived_verifier(spec)
        return validated(cls, spec)

    def to_manifest_dict(self) -> dict[str, Any]:
        """The manifest fields, as ``VariantManifest.model_validate`` takes them (locations as stored)."""
        mine = self.model_dump()
        return {theirs: mine[ours] for theirs, ours in _MANIFEST_FIELDS.items()}


class VariantEntry(VariantSpec):
    """A registered variant: its spec plus lifecycle, traffic and bookkeeping fields set by the registry."""

    status: VariantStatus = Field("staged", description="staged (registered, no default traffic), active "
                                  "(routable) or retired (kept for the record, no traffic)")
    traffic_weight: float = Field(0.0, ge=0.0, le=1.0, description="Share of unnamed requests among active "
                                  "variants, relative to the other active weights (0.1 with 0.9 = 10 %)")
    revision: int = Field(1, ge=1, description="Revision of this entry: 1 at registration, +1 per change")
    registry_revision: int = Field(0, ge=0, description="The global registry revision of this entry's last change")
    created_at_s: float = Field(0.0, ge=0.0, description="Registration time, Unix seconds")
    updated_at_s: float = Field(0.0, ge=0.0, description="Time of the last change, Unix seconds")

    @property
    def spec(self) -> VariantSpec:
        """The spec part, without lifecycle and bookkeeping."""
        return VariantSpec.model_validate(self.model_dump(include=set(VariantSpec.model_fields)))


def validated(cls: type[M], data: Mapping[str, Any]) -> M:
    """``cls.model_validate(data)``, raising ``InvalidVariant`` that names the first failing field and rule."""
    try:
        return cls.model_validate(dict(data))
    except ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidVariant):
            raise InvalidVariant(cause.field, cause.rule) from e
        field = ".".join(str(x) for x in first["loc"]) or "variant"
        msg = str(first["msg"])
        raise InvalidVariant(field, msg[:1].lower() + msg[1:]) from e


def _derived_verifier(spec: Mapping[str, Any]) -> str | None:
    """``verifier_of`` the tensors the spec's local weight and adapter files change (their safetensors headers);
    None when a file is remote or unreadable, or the layer split is not given."""
    changed: set[str] = set()
    for kind in _LOCATIONS:
        uri = spec.get(f"{kind}_uri")
        if uri is None:
            continue
        names = None if "://" in str(uri) else _safetensors_names(Path(str(uri)))
        if names is None:
            return None
        changed |= changed_tensors(names, adapter=kind == "adapter")
    try:
        e, t, d = (int(spec.get("num_encoding_layers", 0)), int(spec["num_thinking_layers"]),
                   int(spec["num_decoding_layers"]))
    except (KeyError, TypeError, ValueError):
        return None
    return verifier_of(changed, e + t, e + t + d, str(spec.get("head_input", "replace")))


def _safetensors_names(path: Path) -> list[str] | None:
    """Tensor names from a safetensors file's JSON header (no tensor is read); None if it is not one."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    return [str(k) for k in header] if isinstance(header, dict) else None


def _as_dict(manifest: Any) -> dict[str, Any]:
    if isinstance(manifest, Mapping):
        return dict(manifest)
    if isinstance(manifest, BaseModel):
        return manifest.model_dump()
    return {k: getattr(manifest, k) for k in _MANIFEST_FIELDS if hasattr(manifest, k)}
