"""Chat-style user prompts written by the base model itself (the Magpie recipe), for a chat corpus.

The instruct model is given its chat template up to the start of a user turn and nothing else; sampling
from there yields the kind of request it was tuned on. Requests are kept when they end their turn, are
4..60 tokens long, are new (case- and space-folded), and share no topic word with the chat prompts the
benchmarks and the demo measure on (``dmtd.bench.exact_bench.CHATS``), so those stay unseen by training.

    .venv/bin/python scripts/chat_prompts.py --num 3000 --out corpora/chat-prompts.jsonl

Deterministic for a seed on one machine (bf16 sampling, seeded per request); the output file is what a
corpus is made from (``dmtd data --prompts FILE --no-builtin``), so it is committed, not re-derived.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dmtd.bench.exact_bench import CHATS  # noqa: E402
from dmtd.engine.config import EngineConfig  # noqa: E402
from dmtd.engine.sequence import SamplingParams  # noqa: E402
from dmtd.variants.build import build_engine, engine_spec  # noqa: E402

SENTINEL = "QQQSENTINELQQQ"
# topic words of the measured chat prompts: a generated request naming one is dropped
BANNED = {"sky", "blue", "lighthouse", "bottle", "focused", "studying", "study", "bicycle", "bike", "pancake",
          "pancakes", "cat", "cats", "purr", "purring", "moon", "lunar", "refrigerator", "fridge"}


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def dropped_for(num_ids: int, finished: bool, req: str, seen: set[str]) -> str | None:
    """Why a sampled request is dropped (``unfinished``, ``length``, ``duplicate``, ``topic``), or None to keep it
    (then it is added to ``seen``)."""
    key = " ".join(req.lower().split())
    if not finished:
        return "unfinished"
    if not 4 <= num_ids <= 60 or "<|" in req or not req:
        return "length"
    if key in seen:
        return "duplicate"
    if words(req) & BANNED:
        return "topic"
    seen.add(key)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=3000, help="prompts to keep")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.98)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert all(words(c) & BANNED for c in CHATS), "every measured chat prompt must have a banned topic word"
    spec = engine_spec(None, "none", dtype=torch.bfloat16, device="cpu")
    engine = build_engine(spec, EngineConfig(max_num_seqs=args.batch_size, max_model_len=512, device="cpu",
                                             dtype="bfloat16"))
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    pre_query = engine.encode(text[: text.index(SENTINEL)])
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    kept: list[str] = []
    seen: set[str] = set()
    dropped = {"unfinished": 0, "length": 0, "duplicate": 0, "topic": 0}
    bar = tqdm(total=args.num, unit="prompt", desc="chat prompts", dynamic_ncols=True)
    n = 0
    while len(kept) < args.num:
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed * 10**7 + n + i,
                                 max_new_tokens=64, stop_token_ids=[end_id]) for i in range(args.batch_size)]
        n += args.batch_size
        for res in engine.generate([list(pre_query)] * args.batch_size, params):
            ids = [t for t in res.token_ids if t != end_id]
            req = tok.decode(ids, skip_special_tokens=True).strip()
            why = dropped_for(len(ids), res.finish_reason == "stop", req, seen)
            if why is not None:
                dropped[why] += 1
            else:
                kept.append(req)
                bar.update(1)
            if len(kept) >= args.num:
                break
        bar.set_postfix(sampled=n, **dropped)
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in kept), encoding="utf-8")
    print(f"{args.out}: {len(kept)} prompts from {n} samples; dropped {dropped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
