"""Export a trained student as a variant directory: ``variant.json`` + weights and/or a LoRA adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dmtd.train.config import TrainConfig
from dmtd.train.corpus import Record
from dmtd.train.lora import low_rank_delta, save_adapter
from dmtd.train.student import DMTDStudent
from dmtd.variants.manifest import MANIFEST_NAME, VariantManifest, sha256_file

WEIGHTS_FILE = "weights.safetensors"
ADAPTER_FILE = "adapter.safetensors"
HELDOUT_FILE = "heldout.jsonl"
HELDOUT_SAMPLE = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_variant(student: DMTDStudent, cfg: TrainConfig, out: Path, base_fingerprint: str, data_hash: str,
                   dtype: str = "float32", default_tau: int | None = None, min_confidence: float = 0.0,
                   extra: dict[str, Any] | None = None, rank: int | None = None,
                   heldout: list[Record] | None = None) -> VariantManifest:
    """Write the trained tensors and a manifest.

    Full-layer scopes write ``weights``; with ``rank`` their matrices are stored instead as a truncated-SVD
    rank-``rank`` adapter of the change from the base (small, lossy; norms stay whole). LoRA scope writes
    its ``adapter`` (+ trained norms).
    """
    out.mkdir(parents=True, exist_ok=True)
    dt = DTYPES[dtype]
    d = student.dmtd
    full = {n: p.detach() for n, p in student.model.named_parameters() if p.requires_grad}
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if rank is not None:
        for n in [n for n, t in full.items() if t.dim() == 2]:
            pairs[n] = low_rank_delta(full.pop(n), _base_tensor(student, n), rank)
    fields: dict[str, Any] = {}
    if full:
        save_file({n: t.to(dt).contiguous() for n, t in full.items()}, str(out / WEIGHTS_FILE),
                  metadata={"base_fingerprint": base_fingerprint})
        fields.update(weights=WEIGHTS_FILE, weights_sha256=sha256_file(out / WEIGHTS_FILE))
    if student.lora is not None:
        student.lora.export(out / ADAPTER_FILE, base_fingerprint, dt)
    elif pairs:
        assert rank is not None
        save_adapter(out / ADAPTER_FILE, pairs, rank, float(rank), base_fingerprint, dt)
    if student.lora is not None or pairs:
        fields.update(adapter=ADAPTER_FILE, adapter_sha256=sha256_file(out / ADAPTER_FILE))
    if heldout:
        (out / HELDOUT_FILE).write_text("".join(r.to_json() + "\n" for r in heldout))
        fields.update(heldout=HELDOUT_FILE)
    manifest = VariantManifest(
        name=cfg.name, base_model=cfg.base_model, num_encoding_layers=d.num_encoding_layers,
        num_thinking_layers=d.num_thinking_layers, num_decoding_layers=d.num_decoding_layers,
        tau_max=cfg.tau_max, default_tau=min(default_tau or cfg.tau_max, cfg.tau_max),
        min_confidence=min_confidence, phase_anchor=d.phase_anchor, head_input=d.head_input,
        base_fingerprint=base_fingerprint, vocab_size=student.model.config.vocab_size,
        recipe=portable_recipe({**cfg.model_dump(), "export_dtype": dtype, "export_rank": rank, **(extra or {})}),
        data_hash=data_hash,
        description=f"DMTD variant of {cfg.base_model}: {cfg.scope} scope, D={d.num_decoding_layers}, "
                    f"τ {cfg.tau_min}..{cfg.tau_max}",
        **fields,
    )
    (out / MANIFEST_NAME).write_text(json.dumps(manifest.model_dump(exclude_none=True), indent=1) + "\n")
    return manifest


def portable_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe without this machine's paths: the corpus and teacher cache relative to the corpora cache, a
    path inside the repository relative to it (a shipped manifest names no machine)."""
    from dmtd.variants.smollm2 import cache_dir

    roots = [cache_dir() / "corpora", Path(__file__).resolve().parents[3]]
    out = dict(recipe)
    for key in ("corpus", "cache", "init_from"):
        v = out.get(key)
        if isinstance(v, str) and Path(v).is_absolute():
            for root in roots:
                if Path(v).is_relative_to(root):
                    out[key] = str(Path(v).relative_to(root))
                    break
    return out


FIELDS = {"self_attn.qkv_proj.weight": "qkv", "self_attn.o_proj.weight": "o", "mlp.gate_up_proj.weight": "gate_up",
          "mlp.down_proj.weight": "down"}


def _base_tensor(student: DMTDStudent, name: str) -> torch.Tensor:
    """The base model's value of a trained layer matrix (the teacher keeps a frozen copy)."""
    _, i, rest = name.split(".", 2)
    t = getattr(student.teacher_ws[int(i)], FIELDS[rest])
    assert t is not None
    return t
