"""Corpus generation speed by batch size: the wide prompt set's sampled completions (T 0.7, top-p 0.95) by the
bf16 engine, one batch of each size in turn, in one process; where `dmtd data --batch-size 64` comes from.

    HF_HUB_OFFLINE=1 bash scripts/quiet.sh .venv/bin/python scripts/bench_datagen_batch.py --sizes 32,64,128
"""

from __future__ import annotations

import argparse
import time

import torch

from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.train.datagen import render_prompt
from dmtd.train.prompts_wide import wide_prompts
from dmtd.variants.build import build_engine, engine_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,64,128")
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    spec = engine_spec(None, "none", dtype=getattr(torch, args.dtype), device="cpu")
    prompts = wide_prompts()[1000:]
    for bs in (int(s) for s in args.sizes.split(",")):
        eng = build_engine(spec, EngineConfig(max_num_seqs=bs, max_model_len=1024, device="cpu", dtype=args.dtype))
        ids = [render_prompt(eng, p) for p in prompts[:bs]]
        params = [SamplingParams(temperature=0.7, top_p=0.95, seed=i, max_new_tokens=args.new_tokens, ignore_eos=True)
                  for i in range(bs)]
        t = time.perf_counter()
        n = sum(len(r.token_ids) for r in eng.generate(ids, params))
        dt = time.perf_counter() - t
        print(f"batch {bs:4d}: {n} tokens in {dt:.1f} s = {n / dt:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
