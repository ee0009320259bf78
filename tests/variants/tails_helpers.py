"""Variants of the shipped variant's trunk made in a test (dmtd.variants.synthetic: a seeded LoRA on the decoding
layers in place of its adapter, its norms and draft vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dmtd.engine.config import ModelConfig
from dmtd.variants.loader import read_config, resolve_model_path
from dmtd.variants.paths import SHIPPED_VARIANTS
from dmtd.variants.synthetic import lora_variant

SHIPPED = SHIPPED_VARIANTS / "smollm2-135m-dmtd"


def make_variant(root: Path, name: str, seed: int, **fields: Any) -> Path:
    """A variant folder ``root`` named ``name`` over the shipped variant's base; ``fields`` override its manifest."""
    config = ModelConfig.from_hf(read_config(resolve_model_path(None)))
    return lora_variant(root, name, SHIPPED, config, seed, **fields)
