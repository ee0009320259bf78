"""``dmtd data`` / ``dmtd train`` / ``dmtd eval``: argument definitions and the glue to the recipe modules."""

from __future__ import annotations

import argparse
from pathlib import Path

from dmtd.engine.config import ConfigError


class TrainInputError(ValueError):
    """Bad input to a training command (missing file, bad option combination): exit code 2."""


def floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from e


def ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="corpus directory (resumed if it exists)")
    p.add_argument("--model", default=None, help="base model: 'smollm2' (default) or a local HF directory")
    p.add_argument("--prompts", type=Path, default=None,
                   help="extra prompts: .txt (one per line) or .jsonl ({'prompt': ..} or {'messages': [..]})")
    p.add_argument("--no-builtin", action="store_true", help="use only --prompts, not the built-in set")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--temperatures", type=floats, default=[0.0, 0.7, 1.0],
                   help="0 = one greedy sample per prompt; the others cycle over the remaining samples")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out", type=float, default=0.03, help="fraction of prompts held out for evaluation")
    p.add_argument("--shard-size", type=int, default=96, help="records per shard (the unit of resumption)")
    p.add_argument("--batch-size", type=int, default=24, help="sequences generated together")
    p.add_argument("--limit", type=int, default=None, help="stop after this many records")


def run_data(args: argparse.Namespace) -> int:
    import torch

    from dmtd.engine.config import EngineConfig
    from dmtd.train.corpus import CorpusConfig
    from dmtd.train.datagen import load_user_prompts, make_corpus
    from dmtd.train.prompts import builtin_prompts, prompts_hash
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.manifest import base_fingerprint

    prompts: list = [] if args.no_builtin else list(builtin_prompts())
    if args.prompts is not None:
        prompts += load_user_prompts(args.prompts)
    if not prompts:
        raise TrainInputError("no prompts: --no-builtin needs --prompts FILE")
    if args.samples_per_prompt < 1 or args.max_new_tokens < 1 or args.batch_size < 1 or args.shard_size < 1:
        raise TrainInputError("--samples-per-prompt, --max-new-tokens, --batch-size and --shard-size must be >= 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = engine_spec(args.model, "none", device=device)
    try:
        cfg = CorpusConfig(
            base_model=str(args.model or "smollm2"), base_fingerprint=base_fingerprint(spec.loaded.path),
            prompts_sha256=prompts_hash(prompts), num_prompts=len(prompts),
            samples_per_prompt=args.samples_per_prompt, temperatures=args.temperatures, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, seed=args.seed, held_out_fraction=args.held_out,
            shard_size=args.shard_size, batch_size=args.batch_size, limit=args.limit)
    except ValueError as e:
        raise TrainInputError(str(e).splitlines()[0] + ": " + str(e).splitlines()[-1].strip()) from e
    max_len = min(spec.loaded.config.max_position_embeddings, 2048)
    engine = build_engine(spec, EngineConfig(max_num_seqs=args.batch_size, max_model_len=max_len, device=device))
    m = make_corpus(args.out, engine, prompts, cfg)
    print(f"corpus {args.out}: {sum(s.num_records for s in m.shards)} records, {m.num_tokens} tokens, "
          f"content hash {m.content_hash}")
    return 0


def check_positive(**kw: float) -> None:
    for k, v in kw.items():
        if v is not None and v <= 0:
            raise ConfigError(f"{k} must be > 0, got {v}")


def add_train_args(p: argparse.ArgumentParser) -> None:
    pass


def run_train(args: argparse.Namespace) -> int:
    raise TrainInputError("not yet")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    pass


def run_eval(args: argparse.Namespace) -> int:
    raise TrainInputError("not yet")
