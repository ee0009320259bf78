"""Would a phrase table of the corpus draft well? A simulation, no engine change.

Counts, over the completions of the corpus mirrors in the repository, which token follows each 3-token context;
then, on the base's greedy answers (≤ 96 tokens) to the eight demo prompts and the 24 validation prompts, how often
the table's most frequent next token exists at a position (seen at least ``count`` times, with share at least
``p``) and how often it is the base's token. Compare with the tails' ~0.6 acceptance at ~0.2 plain steps a draft:
a table's draft costs no pass. With ``--tails``, the shipped variant's tails too, teacher-forced at τ = 2 on the
same answers: how often the tail's draft is right, and how often a confident table token after a right tail draft
would be right as well (a third position for the check, for no draft pass).

    .venv/bin/python scripts/phrase_table_sim.py --tails
"""

from __future__ import annotations

import argparse
import collections
import json
import lzma
import sys
from pathlib import Path

import torch

from dmtd.bench.exact_bench import CHATS
from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec

ROOT = Path(__file__).resolve().parents[1]
N = 3


def confident(table: dict, ctx: tuple[int, ...], p_min: float, c_min: int) -> int | None:
    """The table's most frequent next token after ``ctx``, if seen ``c_min`` times with a share of ``p_min``."""
    c = table.get(ctx)
    if not c:
        return None
    tot = sum(c.values())
    tok, k = c.most_common(1)[0]
    return tok if tot >= c_min and k / tot >= p_min else None


def tails_sim(outs: list, prompts_ids: list[list[int]], table: dict, p_min: float, c_min: int) -> None:
    from dmtd.train.batches import make_batch
    from dmtd.train.corpus import Record
    from dmtd.train.student import DMTDStudent
    from dmtd.variants.build import apply_variant_weights
    from dmtd.variants.loader import load_model
    from dmtd.variants.manifest import read_manifest
    from dmtd.variants.paths import SHIPPED_VARIANTS

    root = SHIPPED_VARIANTS / "smollm2-135m-dmtd"
    m = read_manifest(root)
    loaded = load_model(m.base_model, tokenizer=False)
    student = DMTDStudent(loaded.model, m.dmtd_config(), "all")  # teacher = the untouched base
    apply_variant_weights(loaded, m, root)
    cycles = tail_right = conf = conf_right = ext = 0
    with torch.no_grad():
        for o, pids in zip(outs, prompts_ids):
            rec = Record(0, 0, "train", 0.0, 0, list(pids), list(o.token_ids), "stop")
            b = make_batch([rec], [2], student.dmtd, 512)
            ls, lt = student.forward_pair(b.input_ids, b.head_mask, b.loss_mask)
            pos = b.loss_mask[0].nonzero()[:, 0].tolist()
            tails = (~b.head_mask[0][b.loss_mask[0]]).tolist()
            pred, truth = ls.argmax(-1).tolist(), lt.argmax(-1).tolist()
            seq = b.input_ids[0].tolist()
            for i, (t, is_tail) in enumerate(zip(pos, tails)):
                if not is_tail:
                    continue
                cycles += 1
                right = pred[i] == truth[i]
                tail_right += right
                # the table's token after the tail's draft (context: the two tokens before it and the draft)
                tok = confident(table, (seq[t - 1], seq[t], pred[i]), p_min, c_min)
                if tok is None or i + 1 >= len(truth):
                    continue
                conf += 1
                conf_right += tok == truth[i + 1]
                ext += right and tok == truth[i + 1]
    print(f"tails, τ = 2: {tail_right}/{cycles} drafts right ({tail_right / cycles:.3f}); a confident table token "
          f"after the draft (share >= {p_min}, count >= {c_min}) at {conf} cycles ({conf / cycles:.2f}), right "
          f"{conf_right}, right with a right draft {ext} ({ext / cycles:.3f} extra tokens a cycle)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tails", action="store_true", help="the shipped variant's tails too (teacher-forced, τ = 2)")
    args = ap.parse_args()
    table: dict[tuple[int, ...], collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for mirror in ("corpora/smollm2-sd-wide", "corpora/smollm2-sd-chat"):
        for f in sorted((ROOT / mirror).glob("shard-*.jsonl.xz")):
            for line in lzma.decompress(f.read_bytes()).decode().splitlines():
                ids = json.loads(line)["completion_ids"]
                for i in range(N, len(ids)):
                    table[tuple(ids[i - N: i])][ids[i]] += 1
    print(f"{len(table)} contexts of {N} tokens", file=sys.stderr)
    torch.set_num_threads(2)
    prompts = list(CHATS) + [ln.strip() for ln in (ROOT / "corpora/short-chats-val.txt").read_text().splitlines()
                             if ln.strip()]
    spec = engine_spec(None, "none", dtype=torch.bfloat16, device="cpu")
    eng = build_engine(spec, EngineConfig(max_num_seqs=32, max_model_len=1024, dtype="bfloat16"))
    outs = eng.generate([[{"role": "user", "content": p}] for p in prompts],
                        [SamplingParams(temperature=0.0, max_new_tokens=96) for _ in prompts])
    for p_min in (0.0, 0.3, 0.5, 0.7, 0.9):
        for c_min in (1, 3, 10):
            made = right = pos = 0
            for o in outs:
                ids = list(o.token_ids)
                for i in range(N, len(ids)):
                    pos += 1
                    tok = confident(table, tuple(ids[i - N: i]), p_min, c_min)
                    if tok is None:
                        continue
                    made += 1
                    right += tok == ids[i]
            print(f"share >= {p_min}, count >= {c_min}: a draft at {made}/{pos} positions ({made / pos:.2f}), "
                  f"right {right} ({right / max(made, 1):.2f})")
    if args.tails:
        ids = [eng.encode([{"role": "user", "content": p}]) for p in prompts]
        for p_min, c_min in ((0.5, 3), (0.7, 3), (0.9, 3)):
            tails_sim(outs, ids, table, p_min, c_min)


if __name__ == "__main__":
    main()
