"""What fewer bits in the drafts' weights would cost in acceptance, before anyone writes a kernel for them.

    bash scripts/quiet.sh .venv/bin/python scripts/draft_bits_probe.py --layers none,all,decoding,encoding

The exact profile's drafts run on int8 copies of the tail path's layers (``i8dot``). Here the weights of the chosen
layer groups are first rounded to a symmetric 4-bit grid (one scale per group of ``--group`` inputs, the scale's
clipping chosen per group from a few ratios by least squares: a fair round-to-nearest, no training), then packed
as usual, and fixed τ = 2 (one draft a cycle) runs over the validation chats; the acceptance it prints does not
depend on timing. ``none`` is the shipped drafts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dmtd.cli import SHIPPED_VARIANTS
from dmtd.engine import lowbit
from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec

CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def round4(w: torch.Tensor, group: int) -> torch.Tensor:
    """``w`` [N, K] rounded to codes −8..7 times a per-group scale (the best of CLIPS by squared error)."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    best, err = None, None
    for r in CLIPS:
        s = amax * r / 7.0
        q = torch.round(g / s).clamp(-8, 7) * s
        e = (q - g).pow(2).sum(-1, keepdim=True)
        best, err = (q, e) if best is None else (torch.where(e < err, q, best), torch.minimum(e, err))
    return best.view(N, K)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="none,all,decoding,encoding",
                    help="which draft layers go to 4 bits, one run each: none, all, decoding, encoding")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--variant", default="smollm2-135m-dmtd")
    ap.add_argument("--chats", type=Path, default=Path("corpora/short-chats-val.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    prompts = [ln.strip() for ln in args.chats.read_text().splitlines() if ln.strip()]
    spec = engine_spec(None, args.variant, None, dtype=torch.bfloat16, device="cpu", search_dirs=[SHIPPED_VARIANTS])
    pack = lowbit.pack
    for which in args.layers.split(","):
        # the drafts' weights are packed at the engine's first verified cycle, after it is built
        eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype="bfloat16",
                                              adaptive_drafts=False))
        n_enc = 4 * eng.runner.dmtd.thinking_start  # the encoding group's projections are packed first
        calls = [0]

        def pack4(w: torch.Tensor, fmt: str, which: str = which, calls: list[int] = calls,
                  n_enc: int = n_enc) -> lowbit.PackedWeight:
            if fmt == "i8dot" and w.shape[0] < 8000:  # the layers' projections, not the draft head
                calls[0] += 1
                enc = calls[0] <= n_enc
                if which == "all" or (which == "decoding" and not enc) or (which == "encoding" and enc):
                    w = round4(w.detach().float(), args.group)
            return pack(w, fmt)

        lowbit.pack = pack4  # type: ignore[assignment]
        acc = made = 0
        for p in prompts:
            r = eng.generate([[{"role": "user", "content": p}]], SamplingParams(
                max_new_tokens=args.max_new_tokens, cycle_len=2, exact=True, min_confidence=0.0))[0]
            acc, made = acc + r.num_accepted, made + r.num_drafted
        lowbit.pack = pack  # type: ignore[assignment]
        print(f"4-bit {which:9s} (group {args.group}): {acc}/{made} drafts accepted ({acc / max(made, 1):.4f}) "
              f"on {len(prompts)} chats, fixed τ = 2", flush=True)


if __name__ == "__main__":
    main()
