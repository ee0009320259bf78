"""``dmtd generate``: one or several requests on a local engine (streamed, reported, compared with τ = 1 on the same
engine), or one on a server over gRPC."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from dmtd.cli_args import (
    EXIT_USAGE,
    SERVER_PROFILES,
    UsageError,
    check_generation_args,
    default_variant,
)
from dmtd.variants.paths import SHIPPED_VARIANTS


def generate(args: argparse.Namespace) -> int:
    """``dmtd generate``: on a local engine, or on a server with ``--server``."""
    import torch

    from dmtd.engine.config import EngineConfig
    from dmtd.engine.sequence import SamplingParams
    from dmtd.variants.build import build_engine, engine_spec, variant_precision

    if args.prompt is None and args.chat is None:
        raise UsageError("one of --prompt or --chat is required")
    if args.greedy and args.temperature:
        raise UsageError("--greedy and --temperature > 0 contradict each other")
    check_generation_args(args)
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    if args.repeat > 1 and (args.server or not args.compare_tau1):
        raise UsageError("--repeat applies only with --compare-tau1 on a local engine (not --server)")
    if args.server:
        return generate_remote(args)
    if args.profile in SERVER_PROFILES:
        raise UsageError(f"--profile {args.profile}: the replica controller's profiles ({', '.join(SERVER_PROFILES)}) "
                         "apply only with --server")
    variant = args.variant if args.variant is not None else (
        "none" if args.decoding_layers is not None else default_variant())
    if args.decoding_layers is not None and variant != "none":
        raise UsageError("--decoding-layers applies only with --variant none")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, quant = variant_precision(variant, args.dtype, args.quant, device, [SHIPPED_VARIANTS])
    load_format = getattr(args, "load_format", "auto")
    spec = engine_spec(args.model, variant, args.decoding_layers, dtype=getattr(torch, dtype), device=device,
                       search_dirs=[SHIPPED_VARIANTS], load_format=load_format)
    engine = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, device=device, dtype=dtype,
                                             quant=quant, adaptive_drafts=args.drafts == "adaptive",
                                             context_drafts=not args.no_context_drafts,
                                             phrase_drafts=not args.no_phrase_drafts))
    tau = args.tau if args.tau is not None else spec.default_tau
    profile = args.profile or (spec.variant.default_profile if spec.variant is not None else "dmtd")
    params = SamplingParams(
        temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens, stop=args.stop, tau=tau,
        min_confidence=args.min_confidence if args.min_confidence is not None
        else spec.draft_threshold if profile == "exact" else spec.min_confidence,
        exact=profile == "exact",
    )
    # the exact profile's twin is the base model itself (variant none, same precision and kernels), never the
    # variant engine's own τ = 1 path: "identical" then means identical to what the base model writes
    base_engine = engine
    if args.compare_tau1 and profile == "exact" and variant != "none":
        base_engine = build_engine(engine_spec(args.model, "none", dtype=getattr(torch, dtype), device=device,
                                               load_format=load_format),
                                   EngineConfig(max_num_seqs=1, max_model_len=4096, device=device, dtype=dtype,
                                                quant=quant))
    prompts: list[Any] = [[{"role": "user", "content": c}] for c in args.chat] if args.chat else [args.prompt]
    records = []
    for n, prompt in enumerate(prompts):
        if len(prompts) > 1 and not args.json:
            print(f"{'' if n == 0 else chr(10)}>>> {args.chat[n]}")
        records.append(_generate_local(engine, engine.encode(prompt), params, args, variant, profile, dtype, quant,
                                       base_engine))
    if len(records) > 1 and args.compare_tau1:
        speedups = [r["speedup_vs_tau1"] for r in records]
        same = [r["tokens_match_tau1"] for r in records if "tokens_match_tau1" in r]
        match = f"; tokens identical to the base model's in {sum(same)} of {len(same)}" if same else ""
        print(f"[{len(records)} requests: speedup over τ = 1 mean {sum(speedups) / len(speedups):.2f}× (min "
              f"{min(speedups):.2f}×, max {max(speedups):.2f}×){match}]", file=sys.stderr if args.json else sys.stdout)
    return 0


def _generate_local(engine: Any, prompt_ids: list[int], params: Any, args: argparse.Namespace, variant: str,
                    profile: str, dtype: str, quant: str, base_engine: Any = None) -> dict[str, Any]:
    """One request of ``dmtd generate`` on a local engine: stream it, report it, compare it with τ = 1 (for the
    exact profile: the base model, ``base_engine``, decoding the same request)."""
    base_engine = base_engine or engine
    tau = params.tau
    if args.compare_tau1:  # warm the engine up so the first measured run pays no one-time costs: 16 tokens run
        # each check width twice or more (a shape's first passes cost several plain steps: TorchScript profiles them)
        _stream_local(engine, prompt_ids, dataclasses.replace(params, max_new_tokens=16), echo=False)
    run = _stream_local(engine, prompt_ids, params, echo=not args.json)
    tokens, blocks, tok_s = run.tokens, run.blocks, run.tokens_per_s
    refs: list[LocalRun] = []
    if args.compare_tau1:
        # the same request at τ = 1 (every position a head), measured the same way; for the exact profile on the
        # base model's own engine (--variant none). With --repeat the two alternate.
        own = base_engine is engine
        base = dataclasses.replace(params, tau=1, min_confidence=0.0, exact=params.exact and own)
        if not own:
            _stream_local(base_engine, prompt_ids, dataclasses.replace(base, max_new_tokens=16), echo=False)
        refs.append(_stream_local(base_engine, prompt_ids, base, echo=False))
        for _ in range(args.repeat - 1):
            tok_s = max(tok_s, _stream_local(engine, prompt_ids, params, echo=False).tokens_per_s)
            refs.append(_stream_local(base_engine, prompt_ids, base, echo=False))
    mean_block = sum(blocks) / len(blocks) if blocks else 0.0
    if not args.json:
        print()
    out = sys.stderr if args.json else sys.stdout
    rule = "draft stop" if params.exact else "gate"
    gate = f", {rule} {params.min_confidence:g}" if params.min_confidence > 0 else ""
    checked = ""
    if params.exact:
        rate = run.num_accepted / run.num_drafted if run.num_drafted else 0.0
        context = (f", of them context drafts {run.num_context_accepted}/{run.num_context_drafted}"
                   if run.num_context_drafted else "")
        checked = (f", exact: {run.num_accepted}/{run.num_drafted} drafts accepted ({rate:.0%}, {args.drafts} "
                   f"drafts){context}, verifier {engine.verifier_name}")
    prec = dtype + ("" if quant == "none" else f" {quant}")
    print(f"[{len(tokens)} tokens, {tok_s:.1f} tok/s decode, mean block {mean_block:.2f}, τ={tau}{gate}{checked}, "
          f"{prec}, finish={run.finish_reason}]", file=out)
    record = {
        "prompt_token_ids": prompt_ids, "prompt_tokens": len(prompt_ids), "token_ids": tokens,
        "text": "".join(run.text), "tokens_per_s": tok_s, "mean_block_len": mean_block, "block_lens": blocks,
        "tau": tau, "min_confidence": params.min_confidence, "finish_reason": run.finish_reason, "variant": variant,
        "profile": profile, "dtype": dtype, "quant": quant,
    }
    if params.exact:
        record.update(verifier=engine.verifier_name, num_drafted=run.num_drafted, num_accepted=run.num_accepted,
                      num_context_drafted=run.num_context_drafted, num_context_accepted=run.num_context_accepted,
                      drafts=args.drafts)
    if refs:
        from dmtd.client import compare_with_tau1

        best = max(refs, key=lambda r: r.tokens_per_s)
        compare_with_tau1(record, tokens, tok_s, refs[0].tokens, best.tokens_per_s,
                          f"τ={tau}{gate}" + (f", fastest of {len(refs)} runs each" if len(refs) > 1 else ""),
                          engine.verifier_name if params.exact and params.greedy else None, out,
                          base_model=base_engine is not engine)
        record["runs_each"] = len(refs)
    if args.json:
        print(json.dumps(record))
    return record


@dataclasses.dataclass(slots=True)
class LocalRun:
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    tokens_per_s: float = 0.0
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    num_context_drafted: int = 0
    num_context_accepted: int = 0


def _stream_local(engine: Any, prompt_ids: list[int], params: Any, echo: bool) -> LocalRun:
    """Run one request on a local engine; decode tokens/s counts from the first token."""
    run = LocalRun()
    t_first = None
    for o in engine.stream(prompt_ids, params):
        if t_first is None:
            t_first = time.perf_counter()
        if o.error:
            raise UsageError(o.error)
        if o.token_id >= 0:  # -1: a tail token the confidence gate dropped (redone at a head)
            run.tokens.append(o.token_id)
        run.text.append(o.text_delta)
        if echo:
            print(o.text_delta, end="", flush=True)
        if o.block:
            run.blocks.append(len(o.block))
        run.finish_reason = o.finish_reason
        run.num_drafted += o.num_drafted
        run.num_accepted += o.num_accepted
        run.num_context_drafted += o.num_context_drafted
        run.num_context_accepted += o.num_context_accepted
    dt = time.perf_counter() - (t_first or time.perf_counter())
    run.tokens_per_s = (len(run.tokens) - 1) / dt if dt > 0 and len(run.tokens) > 1 else 0.0
    return run


def generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from dmtd.client import generate_to_console

    if args.decoding_layers is not None or args.model is not None or getattr(args, "load_format", "auto") != "auto":
        raise UsageError("--model, --decoding-layers and --load-format choose a local engine; with --server the "
                         "server decides")
    if args.chat and len(args.chat) > 1:
        raise UsageError("--chat: one message with --server (several run one after another on a local engine)")
    profile = {None: "", "dmtd": "adaptive"}.get(args.profile, args.profile)  # "": the variant's default
    try:
        out = generate_to_console(
            args.server, prompt=args.prompt, chat=args.chat[0] if args.chat else None, variant=args.variant,
            as_json=args.json,
            compare_tau1=args.compare_tau1, max_new_tokens=args.max_new_tokens,
            temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            stop=args.stop, tau_min=args.tau or 0, tau_max=args.tau or 0, min_confidence=args.min_confidence,
            profile=profile,
        )
    except grpc.RpcError as e:
        code = e.code()
        print(f"error: {code.name if code else 'UNKNOWN'}: {e.details()}", file=sys.stderr)
        return EXIT_USAGE if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else 1
    if args.json:
        print(json.dumps(out))
    return 0
