"""The ``dmtd`` command."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


from dmtd.cli_args import (  # noqa: E402
    EXIT_USAGE,
    UsageError,
    add_generation_args,
    default_variant,
)


def _user_errors() -> tuple[type[BaseException], ...]:
    from dmtd.engine.config import ConfigError
    from dmtd.engine.sequence import RequestError
    from dmtd.variants.manifest import ManifestError
    from dmtd.variants.smollm2 import ModelNotFoundError
    from dmtd_contract.serve_config import ServeConfigError

    errors: tuple[type[BaseException], ...] = (UsageError, ConfigError, RequestError, ManifestError,
                                               ModelNotFoundError, ServeConfigError)
    try:
        from dmtd.train.errors import TRAIN_USER_ERRORS
    except ImportError:  # pragma: no cover - a build without the training package
        return errors
    return errors + TRAIN_USER_ERRORS


def cmd_generate(args: argparse.Namespace) -> int:
    from dmtd.generate_cmd import generate

    return generate(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from dmtd.serve.local import serve_main
    from dmtd.variants.loader import LOAD_FORMAT_ENV

    if args.load_format != "auto":  # the replicas' engine builders read it (Ray's processes inherit the environment)
        os.environ[LOAD_FORMAT_ENV] = args.load_format

    variant = args.variant if args.variant is not None else (
        "none" if args.decoding_layers is not None else default_variant())
    return serve_main(args, variant)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from dmtd.bench.serve_bench import run_bench_serve

    run_bench_serve(args, default_variant())
    return 0


def cmd_bench_routing(args: argparse.Namespace) -> int:
    from dmtd.bench.routing_bench import run_routing_bench

    run_routing_bench(args, default_variant())
    return 0


def cmd_cost_report(args: argparse.Namespace) -> int:
    from dmtd.telemetry.report import run_cost_report

    run_cost_report(args)
    return 0


def cmd_shapes(args: argparse.Namespace) -> int:
    """``dmtd shapes list`` / ``dmtd shapes export NAME DIR``."""
    from dmtd.variants.memory import GIB, param_count
    from dmtd.variants.shapes import export_shape, preset, preset_names

    if args.shapes == "export":
        out = export_shape(preset(args.name), args.dir, chat_template=not args.no_chat_template)
        print(f"{out}  (dmtd serve --model {out} --load-format dummy; vllm serve {out} --load-format dummy)")
        return 0
    print(f"{'shape':<14} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'inter':>6} {'vocab':>7} {'params':>7} "
          f"{'bf16 GiB':>8}  source")
    for name in preset_names():
        s = preset(name)
        c = s.model_config()
        n = param_count(c)
        print(f"{name:<14} {c.num_layers:>6} {c.hidden_size:>6} {c.num_heads:>5} {c.num_kv_heads:>3} "
              f"{c.intermediate_size:>6} {c.vocab_size:>7} {n / 1e9:>6.2f}B {2 * n / GIB:>8.1f}  {s.source}")
    return 0


def add_load_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="'dummy' (vLLM's spelling): the model folder's config.json and tokenizer only, seeded random "
                   "weights (a shape without its weights: dmtd shapes export); 'auto': its safetensors")


def cmd_convert(args: argparse.Namespace) -> int:
    from dmtd.variants.smollm2 import smollm2_dir

    print(smollm2_dir())
    return 0


# the in-process benches: name → (module, help); each module dmtd.bench.<stem>_bench has add_<stem>_bench_args and
# run_<stem>_bench
ENGINE_BENCHES = {
    "exact": ("chats_bench", "the exact profile on chat prompts against τ = 1, configurations side by side (adaptive, "
              "fixed, without context or phrase-table drafts), tokens checked equal"),
    "kernels": ("kernel_bench", "bf16 products by rows on every kernel path of this CPU, beside torch's"),
    "prefix": ("prefix_bench", "the engine with and without the prefix cache (shared system prompts), and a stream's "
               "ITL while a long prompt arrives, chunked and whole"),
    "pool": ("pool_bench", "the paged KV pool (64 sequences, 8,192 context) beside 16 fixed slots of 2,048: chat "
             "requests, a burst, one long request beside a full batch"),
    "passes": ("passes_bench", "where a verified cycle's time goes: the engine's passes by kind at each τ, a cycle "
               "priced in plain steps against the tokens it emits"),
    "variants": ("variants_bench", "many variants over one trunk in one engine: one variant at c=16 against several "
                 "mixed in the same batches, the bytes and load time of each added variant, prefix hits across them"),
    "ready": ("ready_bench", "dmtd serve as a new user starts it: the first request's TTFT sent when /v1/models first "
              "answers 200, against the next ones'"),
}


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from dmtd.bench.engine_bench import run_engine_bench

    run_engine_bench(args)
    return 0


def cmd_bench_in_process(args: argparse.Namespace) -> int:
    """``dmtd bench exact|kernels|prefix|pool|passes|ready`` (ENGINE_BENCHES)."""
    import importlib

    module = ENGINE_BENCHES[args.bench][0]
    getattr(importlib.import_module(f"dmtd.bench.{module}"), f"run_{module}")(args)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from dmtd.train.commands import run_data

    return run_data(args)


def cmd_train(args: argparse.Namespace) -> int:
    from dmtd.train.commands import run_train

    return run_train(args)


def cmd_cache(args: argparse.Namespace) -> int:
    from dmtd.train.commands import run_cache

    return run_cache(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from dmtd.train.commands import run_eval

    return run_eval(args)


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from dmtd.train.draft_vocab import run_draft_vocab

    return run_draft_vocab(args)


def cmd_phrase_table(args: argparse.Namespace) -> int:
    from dmtd.train.phrase_table import run_phrase_table

    return run_phrase_table(args)


def bench_autoscale(argv: list[str]) -> int:
    """``dmtd bench autoscale``: the operator's simulator (``python -m dmtd_operator.simulate``), which owns
    its own flags. A separate process: the platform does not import the operator (import-linter)."""
    import subprocess

    return subprocess.call([sys.executable, "-m", "dmtd_operator.simulate", *argv])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmtd", description="Direct Multi-Token Decoding platform")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with a base model or DMTD variant")
    add_generation_args(g)
    add_load_format_arg(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("convert", help="convert the embedded SmolLM2 GGUF into the safetensors cache")
    c.set_defaults(func=cmd_convert)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="HF generate vs engine τ=1 vs DMTD τ=2,3,4 at several batch sizes")
    from dmtd.bench.engine_args import add_engine_bench_args

    add_engine_bench_args(be)
    be.set_defaults(func=cmd_bench_engine)
    import importlib

    for name, (module, help_) in ENGINE_BENCHES.items():
        bp = bsub.add_parser(name, help=help_)
        getattr(importlib.import_module(f"dmtd.bench.{module}"), f"add_{module}_args")(bp)
        bp.set_defaults(func=cmd_bench_in_process)
    # parsed by the simulator itself (see main); listed here for --help
    bsub.add_parser("autoscale", help="replay load traces against the autoscaling policies", add_help=False)
    from dmtd.bench.serve_bench import add_bench_serve_args
    from dmtd.serve.local import add_serve_args

    bs = bsub.add_parser("serve", help="load over real gRPC: τ=1 vs τ=3 vs adaptive at several concurrencies")
    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    br = bsub.add_parser("routing", help="two replicas, shared system prompts: prefix-aware routing beside Serve's "
                         "default, one run")
    from dmtd.bench.routing_bench import add_routing_bench_args

    add_routing_bench_args(br)
    br.set_defaults(func=cmd_bench_routing)
    s = sub.add_parser("serve", help="run the whole stack locally (Ray, registry, gateway, replicas)")
    add_serve_args(s)
    add_load_format_arg(s)
    s.set_defaults(func=cmd_serve)
    sh = sub.add_parser("shapes", help="model shapes without weights: the presets, and folders that this engine and "
                        "vLLM run with --load-format dummy")
    shsub = sh.add_subparsers(dest="shapes", required=True)
    shsub.add_parser("list", help="the presets: layers, sizes, parameters")
    she = shsub.add_parser("export", help="write a preset's folder: config.json and a tokenizer covering its "
                           "vocabulary (no weights)")
    she.add_argument("name", help="a preset (dmtd shapes list)")
    she.add_argument("dir", help="the folder to write (new, empty, or an earlier export)")
    she.add_argument("--no-chat-template", action="store_true",
                     help="a tokenizer without a chat template (a base model's: completions only)")
    sh.set_defaults(func=cmd_shapes)
    from dmtd.telemetry.report import add_cost_report_args

    cost = sub.add_parser("cost", help="cost model")
    cr = cost.add_subparsers(dest="cost", required=True).add_parser(
        "report", help="$/1M tokens, instances and $/month for a daily volume under an SLO, from a bench result")
    add_cost_report_args(cr)
    cr.set_defaults(func=cmd_cost_report)
    from dmtd.registry.cli import add_variants_parser

    add_variants_parser(sub)
    from dmtd.train.commands import add_cache_args, add_data_args, add_eval_args, add_train_args

    d = sub.add_parser("data", help="make a self-distillation corpus with the base model (resumable)")
    add_data_args(d)
    d.set_defaults(func=cmd_data)
    k = sub.add_parser("cache", help="precompute a corpus's frozen-trunk states and teacher top-k targets (resumable)")
    add_cache_args(k)
    k.set_defaults(func=cmd_cache)
    t = sub.add_parser("train", help="cyclical-masking fine-tuning into a DMTD variant (resumable)")
    add_train_args(t)
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("eval", help="evaluate a variant against its base model (quality, speed, frontier)")
    add_eval_args(e)
    e.set_defaults(func=cmd_eval)
    from dmtd.train.draft_vocab import add_draft_vocab_args

    dv = sub.add_parser("draft-vocab", help="coverage of restricted tail vocabularies over corpora; write one "
                        "into a variant (verified cycles)")
    add_draft_vocab_args(dv)
    dv.set_defaults(func=cmd_draft_vocab)
    from dmtd.train.phrase_table import add_phrase_table_args

    pt = sub.add_parser("phrase-table", help="the next token the corpora's answers put after 3-token contexts; "
                        "write it into a variant (drafts of greedy exact requests)")
    add_phrase_table_args(pt)
    pt.set_defaults(func=cmd_phrase_table)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "autoscale"]:
        return bench_autoscale(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
