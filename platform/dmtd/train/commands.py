"""``dmtd data`` / ``dmtd train`` / ``dmtd eval``: argument definitions and the glue to the recipe modules."""

from __future__ import annotations

import argparse
from pathlib import Path


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
    p.add_argument("--prompt-set", choices=["wide", "v1"], default="wide",
                   help="built-in prompts: 'wide' (~4,500: v1 plus long answers, code, lists, multi-turn, "
                   "personas) or 'v1' (~1,000)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="generation precision (bfloat16 measured 2x faster on this project's AVX-512 CPU)")
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
    p.add_argument("--mirror", type=Path, default=None,
                   help="directory of xz-compressed shards of the same corpus (e.g. in the repository): shards it "
                   "holds are restored from it, hash-checked, instead of generated; new shards are added to it")
    p.add_argument("--snapshot-of", type=Path, default=None,
                   help="instead of generating: make --out a fixed corpus from the finished shards of this one")
    p.add_argument("--shards", type=int, default=None, help="with --snapshot-of: how many shards (default all)")


def run_data(args: argparse.Namespace) -> int:
    import torch

    from dmtd.engine.config import EngineConfig
    from dmtd.train.corpus import CorpusConfig
    from dmtd.train.datagen import load_user_prompts, make_corpus
    from dmtd.train.prompts import builtin_prompts, prompts_hash
    from dmtd.train.prompts_wide import wide_prompts
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.manifest import base_fingerprint

    if args.snapshot_of is not None:
        from dmtd.train.corpus import snapshot_corpus

        snap = snapshot_corpus(args.snapshot_of, args.out, args.shards)
        print(f"corpus {args.out}: snapshot of {len(snap.shards)} shards of {args.snapshot_of}, {snap.num_tokens} "
              f"tokens, content hash {snap.content_hash}")
        return 0
    builtin = wide_prompts() if args.prompt_set == "wide" else builtin_prompts()
    prompts: list = [] if args.no_builtin else list(builtin)
    if args.prompts is not None:
        prompts += load_user_prompts(args.prompts)
    if not prompts:
        raise TrainInputError("no prompts: --no-builtin needs --prompts FILE")
    if args.samples_per_prompt < 1 or args.max_new_tokens < 1 or args.batch_size < 1 or args.shard_size < 1:
        raise TrainInputError("--samples-per-prompt, --max-new-tokens, --batch-size and --shard-size must be >= 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = engine_spec(args.model, "none", dtype=getattr(torch, args.dtype), device=device)
    try:
        cfg = CorpusConfig(
            base_model=str(args.model or "smollm2"), base_fingerprint=base_fingerprint(spec.loaded.path),
            prompts_sha256=prompts_hash(prompts), num_prompts=len(prompts),
            samples_per_prompt=args.samples_per_prompt, temperatures=args.temperatures, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, seed=args.seed, held_out_fraction=args.held_out,
            shard_size=args.shard_size, batch_size=args.batch_size, dtype=args.dtype, limit=args.limit)
    except ValueError as e:
        raise TrainInputError(str(e).splitlines()[0] + ": " + str(e).splitlines()[-1].strip()) from e
    max_len = min(spec.loaded.config.max_position_embeddings, 2048)
    engine = build_engine(spec, EngineConfig(max_num_seqs=args.batch_size, max_model_len=max_len, device=device,
                                             dtype=args.dtype))
    m = make_corpus(args.out, engine, prompts, cfg, mirror=args.mirror)
    print(f"corpus {args.out}: {sum(s.num_records for s in m.shards)} records, {m.num_tokens} tokens, "
          f"content hash {m.content_hash}")
    return 0


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True, type=Path, help="corpus directory made by `dmtd data`")
    p.add_argument("--model", default=None, help="base model: 'smollm2' (default) or a local HF directory")
    p.add_argument("--num-encoding-layers", type=int, default=0)
    p.add_argument("--num-decoding-layers", type=int, default=8)
    p.add_argument("--top-k", type=int, default=64, help="teacher token ids kept per position (plus the rest mass)")
    p.add_argument("--hidden-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--temperatures", type=floats, default=None,
                   help="cache only the records sampled at these temperatures, e.g. 0 (the greedy ones; train "
                   "with the same --temperatures); default every record")
    p.add_argument("--out", type=Path, default=None,
                   help="cache directory (default CORPUS/cache-e{E}-d{D}-k{K}-{dtype}[-t{temperatures}])")
    p.add_argument("--batch-size", type=int, default=4, help="records per forward pass")
    p.add_argument("--follow", action="store_true",
                   help="keep caching new shards as `dmtd data` finishes them, until the corpus is complete")
    p.add_argument("--poll-s", type=float, default=60.0, help="seconds between looks at a growing corpus")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run_cache(args: argparse.Namespace) -> int:
    import torch

    from dmtd.train.cache import CacheError, CacheSpec, build_cache
    from dmtd.train.student import DMTDStudent
    from dmtd.train.trainer import dmtd_of_split
    from dmtd.variants.loader import load_model
    from dmtd.variants.manifest import base_fingerprint

    if args.batch_size < 1 or args.poll_s <= 0:
        raise TrainInputError("--batch-size must be >= 1 and --poll-s > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        spec = CacheSpec(args.num_encoding_layers, args.num_decoding_layers, args.top_k, args.hidden_dtype,
                         None if args.temperatures is None else tuple(args.temperatures))
    except CacheError as e:
        raise TrainInputError(f"--{str(e).split(' must')[0].replace('_', '-')}: {e}") from e
    loaded = load_model(args.model or "smollm2", tokenizer=False)
    dmtd = dmtd_of_split(spec.num_encoding_layers, spec.num_decoding_layers, loaded.config.num_layers)
    student = DMTDStudent(loaded.model, dmtd, "decoding")
    root = build_cache(args.corpus, student, spec, base_fingerprint(loaded.path), args.out, args.batch_size,
                       follow=args.follow, poll_s=args.poll_s)
    print(f"teacher cache {root}: up to date with {args.corpus}")
    return 0


def _type_of(annotation: object) -> tuple[type | None, list[str] | None]:
    """argparse type and choices for a TrainConfig field annotation."""
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return str, [str(a) for a in args]
    if args and typing.get_origin(args[0]) is typing.Literal:
        return str, [str(a) for a in typing.get_args(args[0])]
    base = args[0] if args else annotation
    if typing.get_origin(base) is list:
        return None, None
    return (base if isinstance(base, type) else str), None


def add_train_args(p: argparse.ArgumentParser) -> None:
    from dmtd.train.config import TrainConfig

    p.add_argument("--run-dir", type=Path, default=None,
                   help="checkpoints, log and config (default ~/.cache/dmtd/runs/NAME); resumed when it holds a run")
    p.add_argument("--resume-from", type=Path, default=None, help="a specific checkpoint file to resume from")
    p.add_argument("--stop-after", type=int, default=None, help="train at most this many steps in this invocation")
    p.add_argument("--export", type=Path, default=None, help="variant directory to write (default RUN_DIR/variant)")
    p.add_argument("--export-only", action="store_true", help="export the latest checkpoint and exit")
    p.add_argument("--export-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--export-rank", type=int, default=None,
                   help="store trained full-layer matrices as a rank-R (truncated SVD) adapter of their change")
    p.add_argument("--default-tau", type=int, default=None, help="the exported manifest's default_tau")
    p.add_argument("--min-confidence", type=float, default=0.0, help="the exported manifest's min_confidence")
    p.add_argument("--bench", type=int, default=None, metavar="N",
                   help="measure instead of training: N steps uncached and N cached (needs --cache), alternating "
                   "on the same batches in this process; prints tokens/s and the ratio")
    p.add_argument("--bench-json", type=Path, default=None, help="write the --bench result here")
    p.add_argument("--plot", type=Path, default=None, help="write the run's held-out curve (PNG) here and exit")
    g = p.add_argument_group("recipe (TrainConfig; omitted = the resumed run's value or the default)")
    for name, f in TrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        typ, choices = _type_of(f.annotation)
        default = "required for a new run" if f.is_required() else \
            f"default {f.get_default(call_default_factory=True)!r}"
        help_ = f"{f.description or ''} ({default})"
        if typ is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typ is None:
            g.add_argument(flag, default=None, help=help_ + "; comma-separated")
        else:
            g.add_argument(flag, type=typ, choices=choices, default=None, help=help_)


def train_config_from_args(args: argparse.Namespace, run_dir: Path | None) -> tuple[object, Path]:
    import json

    from pydantic import ValidationError

    from dmtd.train.config import TrainConfig
    from dmtd.variants.smollm2 import cache_dir

    given = {k: getattr(args, k) for k in TrainConfig.model_fields if getattr(args, k, None) is not None}
    for key in ("corpus", "init_from", "cache"):
        if isinstance(given.get(key), str) and given[key] != "auto":
            given[key] = str(Path(given[key]).expanduser().resolve())
    if isinstance(given.get("lora_targets"), str):
        given["lora_targets"] = [t for t in given["lora_targets"].split(",") if t]
    if isinstance(given.get("temperatures"), str):
        try:
            given["temperatures"] = floats(given["temperatures"])
        except argparse.ArgumentTypeError as e:
            raise TrainInputError(f"--temperatures: must be comma-separated numbers ({e})") from e
    name = given.get("name", TrainConfig.model_fields["name"].default)
    rd = (run_dir or cache_dir() / "runs" / str(name)).expanduser()
    stored: dict = {}
    if (rd / "config.json").is_file():
        try:
            stored = json.loads((rd / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise TrainInputError(f"{rd / 'config.json'}: corrupted ({e})") from e
    try:
        cfg = TrainConfig.model_validate({**stored, **given})
    except ValidationError as e:
        first = e.errors()[0]
        loc = "--" + ".".join(str(x) for x in first["loc"]).replace("_", "-")
        raise TrainInputError(f"{loc}: {first['msg']}") from e
    return cfg, rd


def run_train(args: argparse.Namespace) -> int:

    from dmtd.train.config import TrainConfig
    from dmtd.train.export import HELDOUT_SAMPLE, export_variant
    from dmtd.train.trainer import Trainer

    cfg, run_dir = train_config_from_args(args, args.run_dir)
    assert isinstance(cfg, TrainConfig)
    if args.plot is not None:
        from dmtd.train.plots import plot_curve

        plot_curve(run_dir / "log.jsonl", args.plot, title=cfg.name)
        print(f"wrote {args.plot}")
        return 0
    if args.bench is not None:
        from dmtd.train.bench import bench_train

        if args.bench < 1 or cfg.cache is None:
            raise TrainInputError("--bench: needs N >= 1 and --cache (the cached path it compares against)")
        bench_train(cfg, args.bench, args.bench_json)
        return 0
    if args.export_only and not (run_dir / "latest.json").is_file() and args.resume_from is None:
        raise TrainInputError(f"--export-only: {run_dir} holds no checkpoint")
    trainer = Trainer(cfg, run_dir, resume_from=args.resume_from)
    if not args.export_only:
        if trainer.state.step:
            print(f"resuming {run_dir} at step {trainer.state.step}")
        stop = None if args.stop_after is None else trainer.state.step + args.stop_after
        trainer.run(stop_at=stop)
    out = args.export or run_dir / "variant"
    m = export_variant(trainer.student, cfg, out, trainer.fingerprint, trainer.corpus.content_hash,
                       args.export_dtype, args.default_tau, args.min_confidence,
                       {"steps": trainer.state.step, "tokens_seen": trainer.state.tokens_seen},
                       rank=args.export_rank, heldout=trainer.heldout[:HELDOUT_SAMPLE])
    print(f"step {trainer.state.step}: exported variant {m.name!r} to {out}")
    return 0


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default=None, help="variant name or manifest path (default: the shipped one)")
    p.add_argument("--model", default=None, help="base model (default: the manifest's base_model)")
    p.add_argument("--corpus", type=Path, default=None,
                   help="corpus whose held-out split is used (default: the variant recipe's corpus)")
    p.add_argument("--quick", action="store_true", help="a small subset that runs in a few minutes")
    p.add_argument("--taus", type=ints, default=None, help="cycle lengths to evaluate (default 2,3,4)")
    p.add_argument("--confidences", type=floats, default=None, help="min_confidence sweep for the frontier")
    p.add_argument("--frontier-taus", type=ints, default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--exact-taus", type=ints, default=None,
                   help="τ of the exact-profile rows (verified cycles; default 2,3,4, --quick 3; '' = none)")
    p.add_argument("--draft-threshold", type=float, default=None,
                   help="exact rows: stop drafting at a draft below this top-1 probability (default: the variant's "
                   "min_confidence)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="float32",
                   help="precision of the engines judged and timed (auto: bfloat16 on a CPU with AVX-512 or AVX2); the "
                   "judge and the teacher-forced agreement stay float32")
    p.add_argument("--quant", choices=("none", "int8", "int4"), default="none",
                   help="weight-only quantisation of the engines judged and timed")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--png", type=Path, default=None, help="plot quality and speed against τ, and the frontier")
    p.add_argument("--record", action="store_true",
                   help="write the headline results into the variant's manifest (its `eval` field)")


def run_eval(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch

    from dmtd.train.corpus import load_corpus, parse_records
    from dmtd.train.evaluate import EvalConfig, Evaluator
    from dmtd.train.plots import plot_report, summary_lines
    from dmtd.variants.build import find_variant
    from dmtd.variants.loader import load_model
    from dmtd.variants.manifest import read_manifest

    shipped = Path(__file__).resolve().parent.parent / "variants" / "shipped"
    name = args.variant
    if name is None:
        names = sorted(p.parent.name for p in shipped.glob("*/variant.json"))
        if not names:
            raise TrainInputError("no --variant given and no shipped variant exists")
        name = names[0]
    mpath = find_variant(name, [shipped])
    manifest = read_manifest(mpath)
    root = mpath if mpath.is_dir() else mpath.parent
    recorded = None  # the recipe names its corpus relative to the corpora cache (older manifests: a full path)
    if manifest.recipe and "corpus" in manifest.recipe:
        from dmtd.variants.smollm2 import cache_dir

        recorded = cache_dir() / "corpora" / str(manifest.recipe["corpus"])
    corpus_path = args.corpus or (recorded if recorded is not None and recorded.is_dir() else None)
    if corpus_path is None and manifest.heldout is None:
        raise TrainInputError("--corpus is required (the variant ships no held-out sample and its training "
                              "corpus is not on this machine)")
    cfg = EvalConfig.quick() if args.quick else EvalConfig()
    for k in ("taus", "confidences", "frontier_taus", "num_prompts", "max_new_tokens", "exact_taus",
              "draft_threshold"):
        if getattr(args, k) is not None:
            setattr(cfg, k, getattr(args, k))
    from dmtd.engine.lowbit import resolve_dtype, weight_format

    cfg.dtype, cfg.quant = resolve_dtype(args.dtype, "cuda" if torch.cuda.is_available() else "cpu"), args.quant
    weight_format(cfg.dtype, cfg.quant)  # a quantisation this machine cannot run: refused before any work
    if any(t < 1 or t > manifest.tau_max for t in cfg.taus + cfg.frontier_taus):
        raise TrainInputError(f"taus must lie in 1..{manifest.tau_max} (the variant's tau_max)")
    if any(t < 2 or t > manifest.tau_max for t in cfg.exact_taus):
        raise TrainInputError(f"--exact-taus: must lie in 2..{manifest.tau_max} (the variant's tau_max; τ = 1 "
                              f"drafts nothing), got {cfg.exact_taus}")
    if cfg.draft_threshold is not None and not 0.0 <= cfg.draft_threshold <= 1.0:
        raise TrainInputError(f"--draft-threshold: must be in [0, 1], got {cfg.draft_threshold}")
    base_name = args.model or manifest.base_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variant = load_model(base_name, device=device)
    base = load_model(base_name, device=device)
    if corpus_path is not None:
        corpus = load_corpus(corpus_path, vocab_size=base.config.vocab_size)
        heldout, source = corpus.split("heldout"), {"path": str(corpus_path), "content_hash": corpus.content_hash}
    else:
        assert manifest.heldout is not None
        sample = root / manifest.heldout
        if not sample.is_file():
            raise TrainInputError(f"the variant's held-out sample {str(sample)!r} is missing; pass --corpus")
        heldout = parse_records(sample.read_bytes(), str(sample))
        source = {"path": str(sample), "content_hash": manifest.data_hash or ""}
    if not heldout:
        raise TrainInputError(f"no held-out records in {source['path']!r}")
    ev = Evaluator(variant, manifest, root, base, cfg, device)
    report = ev.run(heldout)
    report["config"] = dataclasses.asdict(cfg)
    report["corpus"] = source
    for line in summary_lines(report):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.png:
        plot_report(report, args.png)
    if args.record:
        import shlex
        import sys

        from dmtd.train.evaluate import headline
        from dmtd.variants.manifest import MANIFEST_NAME

        argv = [a for a in sys.argv[1:] if a != "--record"]
        command = "dmtd " + " ".join(shlex.quote(a) for a in argv)
        mfile = mpath / MANIFEST_NAME if mpath.is_dir() else mpath
        data = json.loads(mfile.read_text())
        data["eval"] = headline(report, manifest.default_tau, manifest.min_confidence, command)
        tmp = mfile.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=True) + "\n")
        read_manifest(tmp)  # still a valid manifest before it replaces the old one
        tmp.replace(mfile)
        print(f"recorded the headline results in {mfile}")
    return 0
