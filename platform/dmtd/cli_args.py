"""The arguments ``dmtd generate`` and the commands beside it share, and the usage error every command raises: kept
apart from the command table (dmtd.cli), which imports the commands, so that no command imports it back."""

from __future__ import annotations

import argparse

from dmtd.variants.paths import SHIPPED_VARIANTS
from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: printed as ``error: ...`` with exit code 2."""



PROFILES = ("dmtd", "exact")
SERVER_PROFILES = ("quality", "balanced", "speed")  # the replica controller's; "dmtd" there is its adaptive one


def default_variant() -> str:
    """The shipped variant if one exists, else the plain base model."""
    if SHIPPED_VARIANTS.is_dir():
        names = sorted(p.parent.name for p in SHIPPED_VARIANTS.glob("*/variant.json"))
        if names:
            return names[0]
    return "none"


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="base model: 'smollm2' (default) or a local HF directory")
    p.add_argument("--variant", default=None,
                   help="DMTD variant name or manifest path; 'none' = the plain base model "
                   "(default: the shipped variant, if any)")
    p.add_argument("--decoding-layers", type=int, default=None,
                   help="with --variant none: run the base model with DMTD routing and this many decoding layers")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="raw prompt text")
    src.add_argument("--chat", action="append", default=None, metavar="MESSAGE",
                     help="a user message rendered with the model's chat template; repeat it for several requests "
                     "one after another (with --compare-tau1 a last line sums them up; with --json one JSON "
                     "line each)")
    p.add_argument("--tau", type=int, default=None, help="cycle length τ (default: the variant's)")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="end a cycle early when a tail token's top-1 probability is below this (with "
                   "--profile exact: stop drafting there)")
    p.add_argument("--profile", choices=PROFILES + SERVER_PROFILES, default=None,
                   help="'dmtd': tails emit their tokens (gated); 'exact': verified cycles — tails are drafts "
                   "the next head checks, so the output is the verifier's (the base model for adapter "
                   "variants); with --server also the controller's 'quality', 'balanced', 'speed' (and 'dmtd' "
                   "is its adaptive profile); default: the variant's")
    p.add_argument("--drafts", choices=("adaptive", "fixed"), default="adaptive",
                   help="exact profile, local engine: 'adaptive' drafts per cycle the count with the most expected "
                   "tokens per measured cost, none where none pays (never much slower than the base alone); "
                   "'fixed' drafts up to τ − 1 each cycle (stopping at --min-confidence)")
    p.add_argument("--no-context-drafts", action="store_true",
                   help="exact profile, adaptive drafts, greedy: tails only; by default a cycle may instead check the "
                   "tokens that followed an earlier occurrence of the context's last 3 tokens (prompt lookup) or "
                   "the variant's phrase table's, or go on from the tails' drafts with the table's, where the "
                   "policy expects more tokens per cost of it")
    p.add_argument("--no-phrase-drafts", action="store_true",
                   help="as the default, without the variant's phrase table (prompt lookup and tails only)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default unless --temperature)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS_DEFAULT)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--compare-tau1", action="store_true",
                   help="then run the same request at τ = 1 on the same engine (or server) and report the speedup; "
                   "for the exact profile, greedy, also whether the tokens are τ = 1's")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="with --compare-tau1 on a local engine: run the request and its τ = 1 twin N times each, "
                   "alternately, and compare the fastest run of each (a busy machine only ever slows a run down, "
                   "so the fastest is the least disturbed; the tokens are the first run's)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="generate through a running dmtd gateway (gRPC) instead of a local engine")
    add_precision_args(p)


def add_precision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="weights and activations: 'auto' (bfloat16 on a CPU with AVX-512 or AVX2, else float32; "
                   "every profile, the exact one's tokens are the verifier's bit for bit in either; the default "
                   "unless the variant recommends one)")
    p.add_argument("--quant", choices=("none", "int8", "int4"), default=None,
                   help="weight-only low-bit projections and lm_head (CPU kernels built once for this CPU; "
                   "default: the variant's recommendation, else none)")


def check_generation_args(args: argparse.Namespace) -> None:
    """The request's fields checked before any work (model load, connection); errors name the field."""
    from dmtd.engine.sequence import SamplingParams

    SamplingParams(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, max_new_tokens=args.max_new_tokens, stop=args.stop, tau=args.tau,
                   min_confidence=0.0 if args.min_confidence is None else args.min_confidence)
