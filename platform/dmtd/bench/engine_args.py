"""Arguments of ``dmtd bench engine`` (kept apart so the CLI parser stays import-light)."""

from __future__ import annotations

import argparse


def add_engine_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="base model (default: the embedded SmolLM2)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="'dummy' (vLLM's spelling): --model's config.json and tokenizer with seeded random weights, a "
                   "shape without its weights (dmtd shapes export; docs/shapes.md); needs --no-hf, no --llama-cpp")
    p.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16"), default="auto",
                   help="the bfloat16 rows' KV cache: auto (float32) or bfloat16 (half the bytes; the CPU kernels' "
                   "attention, not on the amx path)")
    p.add_argument("--decoding-layers", type=int, default=8, help="D for the DMTD rows")
    p.add_argument("--taus", default="2,3,4", help="DMTD cycle lengths to measure")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prefill-lens", default="", metavar="LIST",
                   help="also time one prompt's prefill at these lengths, e.g. 512,2048 (prompt tok/s)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per configuration (best is kept)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers generate baseline")
    p.add_argument("--variant", default=None,
                   help="variant for the exact-profile rows (default: the shipped variant; 'none' skips them)")
    p.add_argument("--exact-taus", default="2,3", help="τ of the exact-profile rows (verified cycles)")
    p.add_argument("--draft-threshold", type=float, default=None,
                   help="exact rows: stop drafting at a draft below this top-1 probability (default: the variant's "
                   "min_confidence)")
    p.add_argument("--precisions", default="float32,bfloat16,int8,int4",
                   help="weight formats to measure side by side (comma list of float32, bfloat16, int8, int4; "
                   "int formats keep float32 activations); float32 always runs, as the reference")
    p.add_argument("--no-reference", action="store_true",
                   help="no float32 rows and no quality check (the ratios are then over the first precision's τ = 1): "
                   "a large shape's float32 model costs twice bf16's memory and its rows the run's longest time")
    p.add_argument("--quality-prompts", type=int, default=8,
                   help="chat prompts of the quality check (greedy agreement with fp32, judge perplexity)")
    p.add_argument("--quality-tokens", type=int, default=48, help="greedy tokens per quality prompt")
    p.add_argument("--llama-cpp", action="store_true",
                   help="add llama.cpp (llama-cpp-python, `make bench-deps`) on the package's GGUF at batch 1")
    p.add_argument("--exact-precision", default="bfloat16", choices=("float32", "bfloat16", "int8", "int4"),
                   help="precision of the exact-profile rows (default: bfloat16, what dmtd serve runs; float32 and "
                   "bfloat16 tokens are the verifier's at that precision bit for bit)")
    p.add_argument("--draft-quants", default="auto",
                   help="exact rows: the drafts' weights, side by side (comma list of auto, none, int8; "
                   "int8: int8 x int8 dot products, AVX512-VNNI or AVX2)")
    p.add_argument("--oracle-acceptance", default="", metavar="LIST",
                   help="add verified cycles of --oracle-tau whose drafts are the base's own greedy tokens, each "
                   "accepted with these probabilities (e.g. 0,0.5,0.8,1): the exact profile's speedup at the shape "
                   "once its acceptance is known; at --exact-precision, every batch; draft passes still run, the "
                   "check still decides")
    p.add_argument("--oracle-tau", type=int, default=3, help="τ of the oracle rows (default 3)")
    p.add_argument("--device", default="cpu",
                   help="where the engine runs: cpu or cuda (cuda: no roofline bounds, no HF or llama.cpp rows)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot path (default: next to --json)")
