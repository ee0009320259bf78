"""Teacher-forced held-out tail top-1 agreement of exported variant directories, on the same records.

    .venv/bin/python scripts/heldout_agreement.py 64 RUN/variant /tmp/cand64 /tmp/cand128

Each variant is loaded as `dmtd generate` loads it (adapter merged over the base) and scored in float32 at
τ = 2, 3, 4 on the first N records of the first variant's ``heldout.jsonl``: how much an export's rank costs.

With ``--chat P …`` the records are instead the base model's own greedy answers (128 tokens, through the first
variant's exact profile at τ = 2 in bf16, whose tokens are the base's), and each variant's exact profile's
acceptance on them is printed too: how far chat prompts sit from the corpus's held-out records. ``--chat-file
corpora/short-chats-val.txt`` holds 24 short direct requests in the style of the demo's eight (none of their
topics): a validation set to choose a variant by, so that the demo's prompts stay a test.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dmtd.train.corpus import Record, parse_records
from dmtd.train.metrics import teacher_forced
from dmtd.train.student import DMTDStudent
from dmtd.variants.build import apply_variant_weights
from dmtd.variants.loader import load_model
from dmtd.variants.manifest import read_manifest


def chat_records(root: Path, prompts: list[str]) -> list[Record]:
    from dmtd.engine.config import EngineConfig
    from dmtd.engine.sequence import SamplingParams
    from dmtd.variants.build import build_engine, engine_spec

    spec = engine_spec(None, str(root), None, dtype=torch.bfloat16, device="cpu", search_dirs=[root.parent])
    eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype="bfloat16", adaptive_drafts=False))
    records, drafted, accepted = [], 0, 0
    for i, p in enumerate(prompts):
        ids = eng.encode([{"role": "user", "content": p}])
        r = eng.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=128, tau=2, exact=True))[0]
        records.append(Record(i, i, "heldout", 0.0, 0, ids, r.token_ids[len(ids):], r.finish_reason or "length"))
        drafted, accepted = drafted + r.num_drafted, accepted + r.num_accepted
    print(f"{root} exact profile, τ = 2, bf16: {accepted}/{drafted} drafts accepted "
          f"({accepted / max(drafted, 1):.4f}) on {len(prompts)} chat prompts", flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", type=int, help="held-out records to score")
    ap.add_argument("variants", type=Path, nargs="+", help="variant directories")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat", nargs="+", metavar="PROMPT", help="score the base's greedy answers to these instead")
    ap.add_argument("--chat-file", type=Path, help="the same, one prompt a line (e.g. corpora/short-chats-val.txt)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.chat_file is not None:
        args.chat = (args.chat or []) + [ln.strip() for ln in args.chat_file.read_text().splitlines() if ln.strip()]
    records = chat_records(args.variants[0], args.chat) if args.chat else None
    for root in args.variants[1:] if args.chat else []:  # each one's own acceptance on the same prompts
        chat_records(root, args.chat)
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
