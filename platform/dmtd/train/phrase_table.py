"""``dmtd phrase-table``: the variant's phrase table (dmtd.engine.phrase_table) from corpora of the base model's
answers.

For every 3-token context of the answers in the corpora's training split (the prompt's last three tokens lead into
each answer), and every 2-token one, the token that followed it most often; kept where the context was seen at least
``--min-count`` times and that token had at least ``--min-share`` of its continuations. Reports how often the table
names the next token of the corpora's held-out greedy answers, and how often rightly; ``--write`` stores it in the
variant.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from dmtd.engine.phrase_table import PHRASE_TABLE_FORMAT, SOURCES, N, PhraseTable
from dmtd.train.corpus import Record, load_corpus
from dmtd.variants.manifest import (
    MANIFEST_NAME,
    ManifestError,
    VariantManifest,
    read_manifest,
    sha256_file,
    update_manifest,
)

FILE_NAME = "phrase_table.safetensors"


def answer_ids(r: Record, n: int = N) -> list[int]:
    """The ids a table of n-token contexts learns from: the prompt's last n (they lead into the answer), then the
    answer."""
    return list(r.prompt_ids[-n:]) + list(r.completion_ids)


def build(records: list[Record], vocab_size: int, min_count: int, min_share: float) -> PhraseTable:
    """The table of ``records``' N-token and (N - 1)-token contexts (see the module's docstring)."""
    return PhraseTable(vocab_size, _contexts(records, vocab_size, min_count, min_share, N),
                       _contexts(records, vocab_size, min_count, min_share, N - 1))


def _contexts(records: list[Record], vocab_size: int, min_count: int, min_share: float,
              n: int) -> dict[int, tuple[int, int]]:
    """Packed n-token context → (its most frequent next token, that token's share in percent), where kept."""
    if vocab_size ** (n + 1) >= 2 ** 63:
        raise ManifestError(f"vocabulary of {vocab_size}: too large for a phrase table ({n + 1}-grams packed in "
                            "64 bits)")
    grams = []
    for r in records:
        t = torch.tensor(answer_ids(r, n), dtype=torch.int64)
        if len(t) > n:
            k = torch.zeros(len(t) - n, dtype=torch.int64)
            for j in range(n + 1):
                k = k * vocab_size + t[j: len(t) - n + j]
            grams.append(k)
    if not grams:
        return {}
    keys, counts = torch.unique(torch.cat(grams), return_counts=True)  # sorted: by context, then next token
    ctx, nxt = keys // vocab_size, keys % vocab_size
    _, group, _ = torch.unique_consecutive(ctx, return_inverse=True, return_counts=True)
    size = int(group.max()) + 1
    total = torch.zeros(size, dtype=torch.int64).index_add_(0, group, counts)
    top = torch.zeros(size, dtype=torch.int64).scatter_reduce(0, group, counts, "amax")
    idx = (counts == top[group]).nonzero()[:, 0]  # each context's most frequent tokens; the first (lowest id) kept
    g = group[idx]
    lead = torch.ones_like(g, dtype=torch.bool)
    lead[1:] = g[1:] != g[:-1]
    first = torch.zeros_like(counts, dtype=torch.bool)
    first[idx[lead]] = True
    share = counts.double() / total[group].double()
    keep = first & (total[group] >= min_count) & (share >= min_share)
    pct = (share[keep] * 100).floor().to(torch.int64)
    return dict(zip(ctx[keep].tolist(), zip(nxt[keep].tolist(), pct.tolist())))


ALL = "all"  # evaluate's key of every position


def evaluate(table: PhraseTable, records: list[Record]) -> dict[str, tuple[int, int]]:
    """Source (dmtd.engine.phrase_table.SOURCES) → (positions where the table names a token from it, of them
    right) over ``records``' answers; ``ALL``: every position, (positions, 0)."""
    out = {ALL: [0, 0], **{s: [0, 0] for s in SOURCES}}
    for r in records:
        ids = answer_ids(r)
        for i in range(N, len(ids)):
            out[ALL][0] += 1
            hit = table.lookup(ids[i - N: i])
            if hit is not None:
                out[hit[1]][0] += 1
                out[hit[1]][1] += hit[0] == ids[i]
    return {s: (a, b) for s, (a, b) in out.items()}


def write(mpath: Path, manifest: VariantManifest, table: PhraseTable, meta: dict[str, str]) -> Path:
    """Store the table beside the manifest and name it in it, validated before it replaces the old one."""
    path = mpath.parent / FILE_NAME
    tensors = {}
    for suffix, entries in (("", table.entries), ("2", table.short)):
        items = sorted(entries.items())
        tensors.update({f"keys{suffix}": torch.tensor([k for k, _ in items], dtype=torch.int64),
                        f"next{suffix}": torch.tensor([t for _, (t, _) in items], dtype=torch.int32),
                        f"share{suffix}": torch.tensor([p for _, (_, p) in items], dtype=torch.uint8)})
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # the old table stays whole until the new one is
    save_file(tensors, str(tmp), metadata={"format": PHRASE_TABLE_FORMAT, "vocab_size": str(table.vocab_size), **meta})
    tmp.chmod(0o644)
    os.replace(tmp, path)
    update_manifest(mpath, manifest, phrase_table=FILE_NAME, phrase_table_sha256=sha256_file(path))
    return path


def add_phrase_table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", action="append", required=True, type=Path, help="corpus directory (repeatable)")
    p.add_argument("--variant", type=Path, required=True, help="variant directory the table is for")
    p.add_argument("--min-count", type=int, default=3, help="times a context was seen (default 3)")
    p.add_argument("--min-share", type=float, default=0.5,
                   help="share of its continuations the kept token had, in (0, 1] (default 0.5)")
    p.add_argument("--write", action="store_true", help="store the table in the variant (default: report only)")


def run_phrase_table(args: argparse.Namespace) -> int:
    if args.min_count < 1:
        raise ManifestError(f"--min-count: must be >= 1, got {args.min_count}")
    if not 0.0 < args.min_share <= 1.0:
        raise ManifestError(f"--min-share: must be in (0, 1], got {args.min_share}")
    mpath = args.variant / MANIFEST_NAME if args.variant.is_dir() else args.variant
    manifest = read_manifest(mpath)
    if manifest.vocab_size is not None:
        vocab = manifest.vocab_size
    else:
        from dmtd.variants.loader import load_model

        vocab = load_model(manifest.base_model, tokenizer=False).config.vocab_size
    corpora = [load_corpus(d, vocab_size=vocab) for d in args.corpus]
    train = [r for c in corpora for r in c.split("train")]
    held = [r for c in corpora for r in c.split("heldout") if r.temperature == 0.0]
    table = build(train, vocab, args.min_count, args.min_share)
    found = evaluate(table, held)
    pos = max(found.pop(ALL)[0], 1)
    named, right = sum(n for n, _ in found.values()), sum(r for _, r in found.values())
    print(f"{len(table.entries)} contexts of {N} tokens and {len(table.short)} of {N - 1} from {len(train)} training "
          f"answers; on {len(held)} held-out greedy answers the table names the next token at {named}/{pos} positions "
          f"({named / pos:.3f}), right at {right} ({right / max(named, 1):.3f}); by source "
          + ", ".join(f"{s}: {n / pos:.3f} of positions, {r / max(n, 1):.3f} right" for s, (n, r) in found.items()))
    if args.write:
        digest = hashlib.sha256(",".join(c.content_hash for c in corpora).encode()).hexdigest()
        path = write(mpath, manifest, table, {"corpora_sha256": digest, "min_count": str(args.min_count),
                                              "min_share": str(args.min_share)})
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) and updated {mpath}")
    return 0
