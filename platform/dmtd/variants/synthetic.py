"""Seeded LoRA variants of a variant's trunk, made without training: its manifest and files, a small random adapter on
the decoding layers in place of its own (a distinct variant, not a copy). Tests and ``dmtd bench variants`` use them to
mix variants and to measure what one more variant costs; nothing ships them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dmtd.engine.config import ModelConfig
from dmtd.variants.build import LORA_FORMAT
from dmtd.variants.manifest import MANIFEST_NAME, read_manifest, sha256_file

COPIED = ("weights", "draft_vocab")  # files kept from the template (its norms, its tail vocabulary)
DROPPED = ("phrase_table", "phrase_table_sha256", "heldout", "eval", "recipe")


def lora_variant(root: Path, name: str, template: Path, config: ModelConfig, seed: int, rank: int = 4,
                 **fields: Any) -> Path:
    """A variant folder ``root`` named ``name``: ``template``'s manifest (a variant folder over a base of ``config``)
    with ``fields`` over it, and a seeded rank-``rank`` adapter on the qkv and down projections of its decoding
    layers."""
    m = read_manifest(template)
    root.mkdir(parents=True, exist_ok=True)
    data = json.loads((template / MANIFEST_NAME).read_text())
    c = config
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = {"self_attn.qkv_proj.weight": (c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim),
              "mlp.down_proj.weight": (c.intermediate_size, c.hidden_size)}
    for i in range(c.num_layers - int(fields.get("num_decoding_layers", m.num_decoding_layers)), c.num_layers):
        for proj, (n_in, n_out) in shapes.items():
            tensors[f"layers.{i}.{proj}.lora_A"] = torch.randn(n_in, rank, generator=g) * 0.02
            tensors[f"layers.{i}.{proj}.lora_B"] = torch.randn(rank, n_out, generator=g) * 0.02
    meta = {"format": LORA_FORMAT, "alpha": str(2.0 * rank), "rank": str(rank), "base_fingerprint": m.base_fingerprint}
    save_file(tensors, str(root / "adapter.safetensors"), metadata={k: v or "" for k, v in meta.items()})
    for f in COPIED:
        rel = data.get(f)
        if rel:
            shutil.copy(template / rel, root / rel)
    for k in DROPPED:
        data.pop(k, None)
    data.update(name=name, adapter="adapter.safetensors", adapter_sha256=sha256_file(root / "adapter.safetensors"),
                description=f"synthetic variant (seeded rank-{rank} LoRA, seed {seed})", **fields)
    if "weights" in data and int(data.get("num_decoding_layers", 0)) != m.num_decoding_layers:
        data.pop("weights"), data.pop("weights_sha256")  # its norms are of other layers
    (root / MANIFEST_NAME).write_text(json.dumps(data, indent=1))
    return root
