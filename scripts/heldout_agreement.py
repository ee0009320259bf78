"""Teacher-forced held-out tail top-1 agreement of exported variant directories, on the same records.

    .venv/bin/python scripts/heldout_agreement.py 64 RUN/variant /tmp/cand64 /tmp/cand128

Each variant is loaded as `dmtd generate` loads it (adapter merged over the base) and scored in float32 at
τ = 2, 3, 4 on the first N records of the first variant's ``heldout.jsonl``: how much an export's rank costs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dmtd.train.corpus import parse_records
from dmtd.train.metrics import teacher_forced
from dmtd.train.student import DMTDStudent
from dmtd.variants.build import apply_variant_weights
from dmtd.variants.loader import load_model
from dmtd.variants.manifest import read_manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", type=int, help="held-out records to score")
    ap.add_argument("variants", type=Path, nargs="+", help="variant directories")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    records = None
    for root in args.variants:
        m = read_manifest(root)
        if records is None:
            if m.heldout is None:
                raise SystemExit(f"{root}: the manifest names no heldout file")
            records = parse_records((root / m.heldout).read_bytes(), m.heldout)[: args.records]
        loaded = load_model(m.base_model, tokenizer=False)
        student = DMTDStudent(loaded.model, m.dmtd_config(), "all")  # teacher = the untouched base
        apply_variant_weights(loaded, m, root)
        r = teacher_forced(student, records, [2, 3, 4], max_len=512)
        print(root, len(records), " ".join(f"τ={t}: {r[t]['tail_agreement']:.4f}" for t in r), flush=True)


if __name__ == "__main__":
    main()
