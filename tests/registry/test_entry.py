"""Entries: validation names the field and rule; manifests convert both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmtd.variants.manifest import VariantManifest
from dmtd_contract.registry import InvalidVariant, VariantEntry, VariantSpec
from dmtd_contract.registry.entry import validated
from dmtd_contract.variant_schema import verifier_of
from tests.registry.conftest import spec

SHA = "ab" * 32


@pytest.mark.parametrize(("fields", "field", "rule"), [
    ({"tau_min": 5}, "tau_min", "must be <= tau_max (4)"),
    ({"tau_min": 4, "default_tau": 3}, "default_tau", "must lie in [tau_min, tau_max] = [4, 4]"),
    ({"tau_max": 17}, "tau_max", "less than or equal to 16"),
    ({"min_confidence": 1.5}, "min_confidence", "less than or equal to 1"),
    ({"name": "Bad Name"}, "name", "should match pattern"),
    ({"weights_uri": "/w.safetensors"}, "weights_sha256", "must be given together"),
    ({"weights_uri": "/w.safetensors", "weights_sha256": "xyz"}, "weights_sha256", "should match pattern"),
    ({"phase_anchor": "middle"}, "phase_anchor", "'prompt_end' or 'absolute'"),
    ({"num_decoding_layers": 0}, "num_decoding_layers", "greater than or equal to 1"),
])
def test_invalid_fields_name_field_and_rule(fields: dict[str, object], field: str, rule: str) -> None:
    with pytest.raises(InvalidVariant) as e:
        validated(VariantSpec, {**spec().model_dump(), **fields})
    assert e.value.field == field
    assert rule in e.value.rule
    assert str(e.value).startswith(f"invalid variant: {field}: ")


def test_entry_rejects_weight_out_of_range_and_manifest_overrides_are_checked() -> None:
    with pytest.raises(InvalidVariant) as e:
        validated(VariantEntry, {**spec().model_dump(), "traffic_weight": 1.2})
    assert e.value.field == "traffic_weight"
    with pytest.raises(InvalidVariant) as e:
        VariantSpec.from_manifest(spec().to_manifest_dict(), tau_min=5)
    assert (e.value.field, e.value.rule) == ("tau_min", "must be <= tau_max (4), got 5")


def test_manifest_round_trip_through_the_real_manifest_class(tmp_path: Path) -> None:
    manifest = VariantManifest.model_validate(dict(
        name="smollm2-d8", num_thinking_layers=22, num_decoding_layers=8, tau_max=4, default_tau=2,
        min_confidence=0.3, phase_anchor="absolute", head_input="residual_add", weights="w/model.safetensors",
        weights_sha256=SHA, description="calibrated", recipe={"lr": 1e-4}))
    path = tmp_path / "v" / "variant.json"
    got = VariantSpec.from_manifest(manifest, path, tau_min=2)
    assert got.weights_uri == str(tmp_path / "v" / "w" / "model.safetensors")
    assert got.manifest_uri == str(path)
    assert (got.tau_min, got.tau_max, got.default_tau, got.min_confidence) == (2, 4, 2, 0.3)
    assert (got.phase_anchor, got.head_input, got.description) == ("absolute", "residual_add", "calibrated")

    back = VariantManifest.model_validate(got.to_manifest_dict())
    mine = manifest.model_dump(exclude={"weights", "recipe"})
    assert back.model_dump(exclude={"weights", "recipe"}) == mine
    assert back.weights == got.weights_uri


def test_manifest_json_defaults_match_the_manifest_class() -> None:
    raw = {"name": "plain", "num_thinking_layers": 22, "num_decoding_layers": 8, "recipe": None}
    ours = VariantSpec.from_manifest(raw).to_manifest_dict()
    theirs = VariantManifest.model_validate(json.loads(json.dumps(raw))).model_dump()
    # the manifest leaves the verifier to be derived at load; the registry derives it at registration
    assert theirs["verifier"] is None and ours.pop("verifier") == "base"  # no files, replace heads: the base
    assert {k: theirs[k] for k in ours} == ours


def test_remote_locations_are_kept_as_given(tmp_path: Path) -> None:
    got = VariantSpec.from_manifest({**spec().to_manifest_dict(), "adapter": "s3://bucket/a.safetensors",
                                     "adapter_sha256": SHA}, tmp_path / "variant.json")
    assert got.adapter_uri == "s3://bucket/a.safetensors"


def test_entry_spec_drops_lifecycle_fields() -> None:
    entry = VariantEntry.model_validate({**spec().model_dump(), "status": "active", "traffic_weight": 0.5})
    assert entry.spec == spec()
    assert type(entry.spec) is VariantSpec


@pytest.mark.parametrize(("changed", "head_input", "want"), [
    (set(), "replace", "base"), (set(), "residual_add", "variant"),
    ({"layers.22.mlp.down_proj.weight", "layers.29.input_layernorm.weight"}, "residual_add", "base"),
    ({"layers.2.mlp.down_proj.weight"}, "replace", "variant"),  # layers.2. is not layers.22.
    ({"layers.22.mlp.down_proj.weight", "norm.weight"}, "replace", "variant"),
])
def test_verifier_rule(changed: set[str], head_input: str, want: str) -> None:
    assert verifier_of(changed, 22, 30, head_input) == want


def test_registry_and_engine_derive_the_same_verifier_for_the_shipped_variant(tmp_path: Path) -> None:
    import shutil

    from dmtd.variants.build import engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    root = tmp_path / "v"
    shutil.copytree(SHIPPED_VARIANTS / "smollm2-135m-dmtd", root)
    data = json.loads((root / "variant.json").read_text())
    data.pop("verifier")
    data["default_profile"] = "exact"
    (root / "variant.json").write_text(json.dumps(data))
    got = VariantSpec.from_manifest(data, root / "variant.json")
    assert (got.verifier, got.default_profile) == (engine_spec(None, str(root)).verifier.name, "exact") == \
        ("base", "exact")
    assert VariantManifest.model_validate(got.to_manifest_dict()).default_profile == "exact"
