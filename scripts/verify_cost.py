"""What a verified cycle's check costs against a plain step, at a given context length, with the decode attention
of `dmtd.engine.decode_kernel` by `dmtd::attend` (kernels/attend.h, the default where the kernels build), by torch's
ops row by row (the path before it), and broadcast over the rows (the path before that).

    .venv/bin/python scripts/verify_cost.py --context 40,600

It decodes the shipped variant's exact profile at τ = 1 (ignoring EOS) to the context length, then times the head's
check over the last token plus 0, 1 and 2 drafts, interleaving the two attention paths in one process; prints the
median milliseconds and the ratios to the plain step (the `check c` of `dmtd bench engine`).
"""

from __future__ import annotations

import argparse
import time

import torch

from dmtd.cli import SHIPPED_VARIANTS
from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="40,600", help="generated tokens before measuring (comma list)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = engine_spec(None, "smollm2-135m-dmtd", None, dtype=getattr(torch, args.dtype), device="cpu",
                       search_dirs=[SHIPPED_VARIANTS])
    for steps in (int(c) for c in args.context.split(",")):
        eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, device="cpu", dtype=args.dtype,
                                              quant="none", adaptive_drafts=False))
        rid = eng.add_request(eng.encode([{"role": "user", "content": "Why is the sky blue?"}]),
                              SamplingParams(max_new_tokens=steps + 50, cycle_len=1, exact=True, ignore_eos=True))
        for _ in range(steps):
            eng.step()
        seq, runner = eng.seqs[rid], eng.runner
        times: dict[tuple[int, int], list[float]] = {}
        paths = {"broadcast": (0, False), "row by row": (8, False)}
        if runner.model.attend_kernel:
            paths["dmtd::attend"] = (8, True)
        for _ in range(args.repeats):
            for name, (loop, attend) in paths.items():
                runner.model.row_loop, runner.model.attend_kernel = loop, attend
                for nd in (0, 1, 2):
                    seq.drafts = [seq.token_ids[-1]] * nd
                    t = time.perf_counter()
                    for _ in range(10):
                        runner.verify([seq])
                    times.setdefault((name, nd), []).append((time.perf_counter() - t) / 10 * 1e3)
        seq.drafts = []
        for name in paths:
            med = [sorted(times[(name, nd)])[len(times[(name, nd)]) // 2] for nd in (0, 1, 2)]
            print(f"context {seq.num_tokens:5d}  {name:12s}  check ms (0/1/2 drafts) "
                  f"{med[0]:6.2f} {med[1]:6.2f} {med[2]:6.2f}   check c {med[1] / med[0]:.3f} {med[2] / med[0]:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
