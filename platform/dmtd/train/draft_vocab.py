"""``dmtd draft-vocab``: the restricted tail vocabulary of verified cycles (FR-Spec, arXiv 2502.14856).

A draft scores only the N tokens most frequent in the base model's own completions; the verifier keeps
the full vocabulary, so the output is unchanged and only drafts outside the N tokens are lost. N is a
trade: coverage of the corpus's completion tokens (the ceiling on acceptance) against the tail's cost,
whose lm_head then reads N rows instead of the whole vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from dmtd.engine.config import ModelConfig, layer_bytes, lm_head_bytes
from dmtd.train.corpus import load_corpus
from dmtd.variants.manifest import (
    MANIFEST_NAME,
    ManifestError,
    VariantManifest,
    read_manifest,
    sha256_file,
    update_manifest,
)

FILE_NAME = "draft_vocab.safetensors"


def completion_counts(corpus_dirs: list[Path]) -> Counter[int]:
    """Token frequencies of the base model's completions over the corpora's training split."""
    counts: Counter[int] = Counter()
    for d in corpus_dirs:
        for r in load_corpus(d).split("train"):
            counts.update(r.completion_ids)
    return counts


def choose(counts: Counter[int], size: int, eos_ids: set[int]) -> list[int]:
    """The ``size`` most frequent ids (ties by id), every EOS id included."""
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    keep = sorted(eos_ids) + [t for t in ranked if t not in eos_ids]
    return keep[:size]


def coverage(counts: Counter[int], ids: list[int]) -> float:
    total = sum(counts.values())
    return sum(counts[t] for t in ids) / total if total else 0.0


def tail_cost(cfg: ModelConfig, num_decoding_layers: int, size: int) -> float:
    """Weight bytes of a tail pass (decoding layers + restricted head) ÷ those of a full pass."""
    full = cfg.num_layers * layer_bytes(cfg) + lm_head_bytes(cfg)
    return (num_decoding_layers * layer_bytes(cfg) + size * cfg.hidden_size * 4) / full


def add_draft_vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", action="append", required=True, type=Path, help="corpus directory (repeatable)")
    p.add_argument("--variant", type=Path, required=True, help="variant directory whose tails draft")
    p.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768", help="sizes to report")
    p.add_argument("--size", type=int, default=None, help="write this size into the variant (default: report only)")
    p.add_argument("--json", dest="json_path", type=Path, default=None)


def run_draft_vocab(args: argparse.Namespace) -> int:
    from dmtd.variants.loader import load_model

    try:
        sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError:
        raise ManifestError(f"--sizes: must be comma-separated integers, got {args.sizes!r}") from None
    mpath = args.variant / MANIFEST_NAME if args.variant.is_dir() else args.variant
    manifest = read_manifest(mpath)
    cfg = load_model(manifest.base_model).config
    for name, n in [("--size", args.size)] + [("--sizes", s) for s in sizes]:
        if n is not None and not 1 <= n <= cfg.vocab_size:
            raise ManifestError(f"{name}: must be in 1..{cfg.vocab_size} (the vocabulary), got {n}")
    counts = completion_counts(args.corpus)
    eos = set(cfg.eos_token_ids)
    rows = [{"size": n, "coverage": coverage(counts, choose(counts, n, eos)),
             "tail_cost": tail_cost(cfg, manifest.num_decoding_layers, n)} for n in sizes + [cfg.vocab_size]]
    print(f"{sum(counts.values())} completion tokens, {len(counts)} distinct")
    print(f"{'size':>7} {'coverage':>9} {'tail cost (× full pass)':>24}")
    for r in rows:
        print(f"{r['size']:>7} {r['coverage']:>9.4f} {r['tail_cost']:>24.3f}")
    if args.json_path:
        args.json_path.write_text(json.dumps({"tokens": sum(counts.values()), "rows": rows}, indent=2))
    if args.size is not None:
        write_draft_vocab(mpath, manifest, choose(counts, args.size, eos), counts)
        print(f"wrote {mpath.parent / FILE_NAME} ({args.size} tokens) and updated {mpath}")
    return 0


def write_draft_vocab(mpath: Path, manifest: VariantManifest, ids: list[int], counts: Counter[int]) -> None:
    """Store the ids beside the manifest and name them in it, validated before it replaces the old one."""
    root = mpath.parent
    path = root / FILE_NAME
    digest = hashlib.sha256(json.dumps(sorted(counts.items())).encode()).hexdigest()
    meta = {"format": "dmtd-draft-vocab-v1", "counts_sha256": digest, "coverage": f"{coverage(counts, ids):.4f}"}
    save_file({"token_ids": torch.tensor(ids, dtype=torch.int32)}, str(path), metadata=meta)
    update_manifest(mpath, manifest, draft_vocab=FILE_NAME, draft_vocab_sha256=sha256_file(path))
