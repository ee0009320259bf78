"""``dmtd bench variants``: many variants over one trunk in one engine, in process. Chat requests at a concurrency
(16) of one variant, then the same requests spread over several variants in the same batches (their trunk rows
together, their tails grouped by variant), alternated in one sitting; the bytes and load time of each variant added
beside the engine's own; the prefix cache's hits across variants on a shared system prompt (a cache keyed by variant,
as vLLM keys it by adapter, misses the first request of each). The exact profile by default (every variant's answer
is the base model's: the tokens are checked equal across the runs)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dmtd.bench.exact_bench import CHATS
from dmtd.bench.prefix_bench import system_prompt


def add_variants_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="smollm2-135m-dmtd", help="the engine's own variant (shipped name or path)")
    p.add_argument("--variants", default="shipped", help="comma-separated variants added beside it (names or paths); "
                   "'shipped': every other shipped variant of its trunk")
    p.add_argument("--synthetic", type=int, default=0, help="also add this many seeded-LoRA variants of the trunk "
                   "(rank 4 on the decoding layers: a load and memory measure, and a mixing partner)")
    p.add_argument("--mix", type=int, default=3, help="variants the mixed run spreads its requests over")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64, help="chat requests of each run")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="one-variant and mixed runs alternated this many times")
    p.add_argument("--numbered", action=argparse.BooleanOptionalAction, default=True,
                   help="distinct prompts (the chats numbered); --no-numbered: the 8 chats asked over and over")
    p.add_argument("--profile", default="exact", choices=("exact", "dmtd"))
    p.add_argument("--system-tokens", type=int, default=512, help="the shared system prompt of the prefix run")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _sources(args: argparse.Namespace, own: str, trunk: Any) -> list[str]:
    """The variants to add: the named ones, or every other shipped variant of the trunk."""
    from dmtd.variants.manifest import ManifestError, read_manifest
    from dmtd.variants.paths import SHIPPED_VARIANTS
    from dmtd.variants.tails import check_shares_trunk

    if args.variants != "shipped":
        return [v for v in args.variants.split(",") if v]
    out = []
    for d in sorted(SHIPPED_VARIANTS.iterdir()):
        if not (d / "variant.json").is_file():
            continue
        m = read_manifest(d)
        try:
            check_shares_trunk(trunk, m)
        except ManifestError:
            continue
        if m.name != own:
            out.append(str(d))
    return out


def closed_loop(engine: Any, prompts: list[Any], variants: list[str], concurrency: int, params: Any,
                ) -> dict[str, Any]:
    """``prompts`` (request ``i`` of variant ``variants[i]``) through ``engine``, ``concurrency`` in flight: output
    tok/s, TTFT, each request's tokens."""
    todo = list(range(len(prompts)))
    live: dict[str, tuple[int, float]] = {}
    tokens: dict[int, list[int]] = {}
    ttft: list[float] = []
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            i = todo.pop(0)
            live[engine.add_request(engine.encode(prompts[i]), params, variant=variants[i])] = (i, time.perf_counter())
            tokens[i] = []
        for o in engine.step():
            if o.req_id not in live:
                continue
            i, added = live[o.req_id]
            if o.token_id >= 0:
                if not tokens[i]:
                    ttft.append(time.perf_counter() - added)
                tokens[i].append(o.token_id)
            if o.finished:
                live.pop(o.req_id)
                engine.release(o.req_id)
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in tokens.values())
    return {"output_tok_s": n / wall, "tokens": n, "wall_s": wall, "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "token_ids": [tokens[i] for i in range(len(prompts))]}


def run_variants_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from dmtd.engine.config import EngineConfig
    from dmtd.engine.sequence import SamplingParams
    from dmtd.variants.build import build_engine, engine_spec, variant_precision
    from dmtd.variants.paths import SHIPPED_VARIANTS
    from dmtd.variants.tails import load_tails, trunk_of

    dtype, quant = variant_precision(args.variant, args.dtype, None, "cpu")
    spec = engine_spec(None, args.variant, dtype=getattr(torch, dtype), search_dirs=[SHIPPED_VARIANTS])
    engine = build_engine(spec, EngineConfig(dtype=dtype, quant=quant, max_num_seqs=args.concurrency,
                                             max_model_len=1024, adaptive_drafts=True))
    trunk = trunk_of(spec.loaded.path, spec.loaded.config, spec.dmtd)
    own = spec.variant.name if spec.variant is not None else "none"
    sources = _sources(args, own, trunk)
    if args.synthetic:
        from dmtd.variants.build import find_variant
        from dmtd.variants.synthetic import lora_variant

        tmp = Path(tempfile.mkdtemp(prefix="dmtd-variants-"))
        template = find_variant(args.variant, [SHIPPED_VARIANTS])
        template = template if template.is_dir() else template.parent
        sources += [str(lora_variant(tmp / f"synthetic-{k}", f"synthetic-{k}", template, spec.loaded.config, seed=k))
                    for k in range(args.synthetic)]
    added: list[dict[str, Any]] = []
    for src in sources:
        rss0, t0 = _rss_bytes(), time.perf_counter()
        got = load_tails(trunk, src, getattr(torch, dtype), [SHIPPED_VARIANTS])
        nbytes = engine.add_variant(got.manifest.name, got.layers)
        del got.layers
        added.append({"name": got.manifest.name, "bytes": nbytes, "rss_delta_bytes": _rss_bytes() - rss0,
                      "load_s": time.perf_counter() - t0})
    names = ["", *(a["name"] for a in added)][: args.mix]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, exact=args.profile == "exact",
                            tau=None if args.profile == "exact" else 3)
    # distinct prompts (the same chats, numbered): no request reads another's answer from the caches
    prompts = [[{"role": "user", "content": CHATS[i % len(CHATS)] + (f" (request {i})" if args.numbered else "")}]
               for i in range(args.requests)]
    closed_loop(engine, prompts[:4], names[:1] * 4, 4, params)  # warm-up (packing, first passes)
    # each variant alone (the engine's own first: "one variant"), then all mixed in the same batches; alternated
    labels = [n or own for n in names]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in [*labels, "mixed"]}
    mixed = [names[i % len(names)] for i in range(len(prompts))]
    for _ in range(args.rounds):
        for name, label in zip(names, labels):
            runs[label].append(closed_loop(engine, prompts, [name] * len(prompts), args.concurrency, params))
        runs["mixed"].append(closed_loop(engine, prompts, mixed, args.concurrency, params))
    same = all(r["token_ids"] == runs[own][0]["token_ids"] for rs in runs.values() for r in rs)
    # the prefix cache across variants: one shared system prompt, requests of each variant in turn
    system = system_prompt(engine, 0, args.system_tokens)
    before = engine.cache_report()
    shared = [[{"role": "system", "content": system}, {"role": "user", "content": CHATS[i % len(CHATS)]}]
              for i in range(2 * len(names))]
    closed_loop(engine, shared, [names[i % len(names)] for i in range(len(shared))], 1,
                SamplingParams(max_new_tokens=8, exact=True))
    after = engine.cache_report()
    hits = after["prefix_hits"] - before["prefix_hits"]
    lookups = after["prefix_lookups"] - before["prefix_lookups"]
    cached = after["prefix_cached_tokens"] - before["prefix_cached_tokens"]
    prompt_tokens = after["prefix_prompt_tokens"] - before["prefix_prompt_tokens"]
    best = {k: max(r["output_tok_s"] for r in v) for k, v in runs.items()}
    # what the mix would make if mixing cost nothing: each request at its own variant's pace (time-weighted)
    alone = len(labels) / sum(1 / best[label] for label in labels)
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "dtype": dtype, "own": own,
              "added": added, "mixed_variants": [n or own for n in names],
              "runs": {k: [{f: r[f] for f in ("output_tok_s", "tokens", "wall_s", "ttft_mean_ms")} for r in v]
                       for k, v in runs.items()},
              "best_tok_s": best, "mixed_over_one": best["mixed"] / best[own],
              "mixed_over_alone": best["mixed"] / alone, "tokens_equal": same,
              "prefix": {"lookups": lookups, "hits": hits, "cached_tokens": cached, "prompt_tokens": prompt_tokens,
                         "hit_ratio": cached / prompt_tokens if prompt_tokens else 0.0,
                         "hits_if_keyed_by_variant": max(0, hits - (len(names) - 1))},
              "cpu": os.cpu_count()}
    _print(result, args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return result


def _print(r: dict[str, Any], args: argparse.Namespace) -> None:
    mb = 1e6
    print(f"\nengine: {r['own']} ({r['dtype']}); variants added beside it:")
    for a in r["added"]:
        print(f"  {a['name']:<32} {a['bytes'] / mb:7.1f} MB held  (RSS +{a['rss_delta_bytes'] / mb:6.1f} MB)  "
              f"loaded in {a['load_s']:.2f} s")
    print(f"\n{args.requests} chat requests at c={args.concurrency}, {args.max_new_tokens} new tokens, "
          f"profile {args.profile}, {args.rounds} rounds alternated")
    for k in r["runs"]:
        figs = ", ".join(f"{x['output_tok_s']:.1f}" for x in r["runs"][k])
        label = f"{len(r['mixed_variants'])} variants mixed" if k == "mixed" else f"{k} alone"
        print(f"  {label:<36} tok/s {figs}  (TTFT mean {r['runs'][k][-1]['ttft_mean_ms']:.0f} ms)")
    print(f"  mixed / {r['own']} alone (best of each): {r['mixed_over_one']:.2f}x; mixed / its variants alone "
          f"(each request at its variant's pace): {r['mixed_over_alone']:.2f}x")
    if args.profile == "exact":
        print(f"  every run's tokens equal (the base model's, whatever the variant): {r['tokens_equal']}")
    p = r["prefix"]
    print(f"\nshared system prompt over {len(r['mixed_variants'])} variants: {p['hits']}/{p['lookups']} lookups hit, "
          f"{p['cached_tokens']}/{p['prompt_tokens']} prompt tokens from the cache ({p['hit_ratio']:.0%}); a cache "
          f"keyed by variant would have hit {p['hits_if_keyed_by_variant']}")
