"""The shipped variant on the real SmolLM2: it fits its base and beats the untrained floor at τ = 2, 3, 4."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmtd.train.corpus import parse_records
from dmtd.train.metrics import teacher_forced
from dmtd.train.student import DMTDStudent
from dmtd.variants.build import apply_variant_weights
from dmtd.variants.loader import load_model
from dmtd.variants.manifest import read_manifest

SHIPPED = Path(__file__).resolve().parents[2] / "platform" / "dmtd" / "variants" / "shipped"
VARIANTS = sorted(p.parent for p in SHIPPED.glob("*/variant.json"))


@pytest.mark.slow
@pytest.mark.parametrize("root", VARIANTS, ids=lambda p: p.name)
def test_shipped_variant_beats_the_floor(root: Path):
    manifest = read_manifest(root)
    assert manifest.heldout is not None and manifest.base_fingerprint is not None
    for rel in (manifest.weights, manifest.adapter):
        if rel is not None:
            assert (root / rel).stat().st_size < 20_000_000
    records = parse_records((root / manifest.heldout).read_bytes(), manifest.heldout)[:6]
    dmtd = manifest.dmtd_config()
    base = load_model(manifest.base_model, tokenizer=False)
    floor = teacher_forced(DMTDStudent(base.model, dmtd, "decoding"), records, [2, 3, 4], max_len=256)
    variant = load_model(manifest.base_model, tokenizer=False)
    student = DMTDStudent(variant.model, dmtd, "all")  # teacher = the untouched base
    apply_variant_weights(variant, manifest, root)
    trained = teacher_forced(student, records, [2, 3, 4], max_len=256)
    for tau in (2, 3, 4):
        assert floor[tau]["tail_agreement"] < 0.15
        assert trained[tau]["tail_agreement"] > floor[tau]["tail_agreement"] + 0.15, (tau, trained, floor)
        assert trained[tau]["nll"] < floor[tau]["nll"]
