"""``dmtd bench prefix``: the engine in process, side by side in one run, with the prefix cache and without it
(shared system prompts: TTFT, output tok/s, cached share), and with chunked prefill and without it (a running
stream's inter-token latency while a long prompt arrives). The shipped variant's exact profile at the serving
default precision, greedy; closed loop at a fixed concurrency."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dmtd.bench.exact_bench import CHATS


def _pace(value: str) -> float:
    x = float(value)
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


def add_prefix_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="smollm2-135m-dmtd", help="shipped variant ('none': the base model)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--prefixes", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="tokens of each shared system prompt (about)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=4096, help="the prompt that arrives mid-stream (ITL run)")
    p.add_argument("--prefill-pace", type=_pace, default=1.0,
                   help="the engine's prefill_pace for the shared-prefix runs and the paced ITL run")
    p.add_argument("--long-prefill-tokens", type=int, default=2048,
                   help="the engine's long_prefill_tokens: shorter prompts are prefilled whole beside decoding")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def _engine(args: argparse.Namespace, **cfg: Any) -> Any:
    import torch

    from dmtd.engine.config import EngineConfig
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    spec = engine_spec(None, args.variant, dtype=getattr(torch, args.dtype), search_dirs=[SHIPPED_VARIANTS])
    base = dict(max_num_seqs=args.concurrency, max_model_len=8192, dtype=args.dtype, adaptive_drafts=True,
                prefill_pace=args.prefill_pace, long_prefill_tokens=args.long_prefill_tokens)
    return build_engine(spec, EngineConfig(**{**base, **cfg}))


def system_prompt(engine: Any, i: int, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens, its own for each ``i``."""
    lines: list[str] = []
    text = ""
    while not text or len(engine.encode(text)) < tokens:
        k = len(lines)
        lines.append(f"Rule {i}.{k}: when asked about topic {k * 7 + i}, answer kindly, briefly and accurately, "
                     f"citing guideline {k + 3 * i} of handbook {i}.")
        text = " ".join(lines)
    return text


def chat(system: str, question: str) -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def closed_loop(engine: Any, prompts: list[str], concurrency: int, max_new: int) -> dict[str, Any]:
    """``prompts`` through ``engine``, ``concurrency`` in flight; TTFT per request and output tok/s."""
    from dmtd.engine.sequence import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, exact=True)
    todo, ttft, tokens = list(prompts), [], 0
    live: dict[str, float] = {}  # request in flight → when it was added
    first: set[str] = set()  # requests that have had their first token
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            live[engine.add_request(engine.encode(todo.pop(0)), params)] = time.perf_counter()
        for o in engine.step():
            if o.req_id not in live:
                continue
            if o.req_id not in first and o.token_id >= 0:
                first.add(o.req_id)
                ttft.append(time.perf_counter() - live[o.req_id])
            tokens += len(o.block or [])
            if o.finished:
                live.pop(o.req_id)
                engine.release(o.req_id)
    wall = time.perf_counter() - t0
    return {"ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "output_tok_s": tokens / wall, "wall_s": wall}


def itl_under_long_prompt(engine: Any, long_prompt: str, max_new: int) -> dict[str, Any]:
    """A stream decodes alone, then a long prompt arrives: the stream's inter-token gaps before and after the
    arrival, and the long prompt's time to its first token."""
    from dmtd.engine.sequence import SamplingParams

    rid = engine.add_request(engine.encode(chat("You are helpful.", CHATS[0])),
                             SamplingParams(max_new_tokens=max_new, exact=True, ignore_eos=True))
    gaps: list[tuple[bool, float]] = []
    last, arrived, step, long_id, t_arrive, ttft = None, False, 0, "", 0.0, 0.0
    while engine.seqs[rid].status.value != "finished" or (long_id and not ttft):
        if step == max_new // 3:
            long_id = engine.add_request(engine.encode(long_prompt), SamplingParams(max_new_tokens=4, exact=True))
            arrived, t_arrive = True, time.perf_counter()
        for o in engine.step():
            now = time.perf_counter()
            if o.req_id == long_id and o.token_id >= 0 and not ttft:
                ttft = now - t_arrive
            if o.req_id == rid and o.token_id >= 0:
                if last is not None:
                    gaps.append((arrived, now - last))
                last = now
        step += 1
    while engine.has_unfinished():
        engine.step()
    steady = sorted(g for a, g in gaps if not a)
    during = sorted(g for a, g in gaps if a)

    def p(xs: list[float], q: float) -> float:
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"steady_p50_ms": p(steady, 0.5), "steady_p99_ms": p(steady, 0.99), "during_p50_ms": p(during, 0.5),
            "during_p99_ms": p(during, 0.99), "during_max_ms": 1e3 * max(during),
            "p99_over_steady_p50": p(during, 0.99) / p(steady, 0.5),
            "p99_over_steady_p99": p(during, 0.99) / p(steady, 0.99), "long_ttft_ms": 1e3 * ttft,
            "gaps_during": len(during)}


def prefill_step(engine: Any, prompts: list[str], repeats: int = 3) -> float:
    """Best seconds until every one of ``prompts``, admitted together (nothing else running), has its first token
    (the steps that prefill them, and the decode steps of those done first)."""
    from dmtd.engine.sequence import SamplingParams

    best = float("inf")
    for _ in range(repeats):
        ids = [engine.add_request(engine.encode(p), SamplingParams(max_new_tokens=2, exact=True)) for p in prompts]
        waiting = set(ids)
        t = time.perf_counter()
        while waiting:
            waiting -= {o.req_id for o in engine.step() if o.token_id >= 0}
        best = min(best, time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
        for r in ids:
            engine.release(r)
    return best


def run_prefix_bench(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "func"}}
    cached, plain = _engine(args), _engine(args, prefix_caching=False)
    systems = [system_prompt(cached, i, args.prefix_tokens) for i in range(args.prefixes)]
    prompts = [chat(systems[i % args.prefixes], CHATS[i % len(CHATS)] + f" (request {i})")
               for i in range(args.requests)]
    warm = [chat("You are helpful.", CHATS[1])]
    rows = {}
    for name, e in tqdm([("prefix cache", cached), ("no prefix cache", plain)], desc="bench prefix (shared)"):
        closed_loop(e, warm, 1, 8)
        rows[name] = closed_loop(e, prompts, args.concurrency, args.max_new_tokens)
        if e.scheduler.prefix is not None:
            st = e.scheduler.prefix.stats
            rows[name]["cached_share"] = st.cached_tokens / max(st.prompt_tokens, 1)
    on, off = rows["prefix cache"], rows["no prefix cache"]
    on["ttft_speedup"] = off["ttft_mean_ms"] / on["ttft_mean_ms"]
    on["tok_s_ratio"] = on["output_tok_s"] / off["output_tok_s"]
    result["shared_prefix"] = rows
    long_prompt = chat(system_prompt(cached, 99, args.long_prompt - 40), CHATS[2])
    itl = {}
    ways = [(f"paced ({args.prefill_pace:g})", {}), ("chunks of 128", {"prefill_pace": 0.0}),
            ("whole prompt", {"prefill_pace": 0.0, "prefill_chunk": 8192})]
    for name, how in tqdm(ways, desc="bench prefix (ITL)"):
        e = _engine(args, max_num_seqs=2, prefix_caching=False, **how)
        closed_loop(e, warm, 1, 8)
        itl[name] = itl_under_long_prompt(e, long_prompt, 240)
    result["itl_long_prompt"] = itl
    chats = [chat("You are helpful.", q) for q in CHATS] * 2
    wide = _engine(args, max_num_seqs=16, prefix_caching=False)
    prefill_step(wide, chats[:1], 1)  # warm-up
    result["prefill_step_ms"] = {n: 1e3 * prefill_step(wide, chats[:n]) for n in (1, 16)}
    print(f"\nshared prefixes: {args.prefixes} × ~{args.prefix_tokens} tokens, {args.requests} requests at "
          f"c={args.concurrency}, {args.max_new_tokens} new tokens, exact profile, {args.dtype}")
    print(f"{'':>16} {'TTFT mean':>10} {'TTFT p50':>9} {'tok/s':>7} {'cached':>7}")
    for name, r in rows.items():
        print(f"{name:>16} {r['ttft_mean_ms']:>8.0f}ms {r['ttft_p50_ms']:>7.0f}ms {r['output_tok_s']:>7.1f} "
              f"{100 * r.get('cached_share', 0):>6.0f}%")
    print(f"\na running stream's inter-token gaps while a ~{args.long_prompt}-token prompt arrives")
    print(f"{'':>16} {'steady p50':>10} {'p99':>6} {'during p50':>10} {'p99':>8} {'max':>8} "
          f"{'p99 ÷ steady p50':>16} {'÷ p99':>6} {'its TTFT':>9}")
    for name, r in itl.items():
        print(f"{name:>16} {r['steady_p50_ms']:>8.0f}ms {r['steady_p99_ms']:>4.0f}ms {r['during_p50_ms']:>8.0f}ms "
              f"{r['during_p99_ms']:>6.0f}ms {r['during_max_ms']:>6.0f}ms {r['p99_over_steady_p50']:>16.2f} "
              f"{r['p99_over_steady_p99']:>6.2f} {r['long_ttft_ms'] / 1e3:>8.1f}s")
    steps = result["prefill_step_ms"]
    print(f"\nchat prompts admitted together, until each has its first token: 1 in {steps[1]:.0f} ms, 16 in "
          f"{steps[16]:.0f} ms")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return result
