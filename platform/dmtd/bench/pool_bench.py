"""``dmtd bench pool``: the engine in process with a replica's KV pool (pages from one pool, 64 sequences, a context
of 8,192), side by side in one run with the 16 fixed slots × 2,048 positions it replaces (the same bytes): chat
requests at a concurrency the slots cannot hold, a burst of many more requests than sequences (queued and preempted,
none lost), and one ~8,000-token request beside a full batch. The shipped variant's exact profile at the serving
default precision, greedy; closed loop."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dmtd.bench.exact_bench import CHATS
from dmtd.bench.prefix_bench import chat, system_prompt


def add_pool_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="smollm2-135m-dmtd", help="shipped variant ('none': the base model)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--concurrency", type=int, default=64, help="chat requests in flight (the paged pool's sequences)")
    p.add_argument("--requests", type=int, default=128, help="chat requests of the concurrency run")
    p.add_argument("--burst", type=int, default=256, help="requests added at once (the burst run)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="the paged pool's positions (16 × 2,048)")
    p.add_argument("--long-prompt", type=int, default=8000, help="tokens of the long request beside the batch")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def _engine(args: argparse.Namespace, **cfg: Any) -> Any:
    import torch

    from dmtd.engine.config import EngineConfig
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    spec = engine_spec(None, args.variant, dtype=getattr(torch, args.dtype), search_dirs=[SHIPPED_VARIANTS])
    return build_engine(spec, EngineConfig(dtype=args.dtype, adaptive_drafts=True, **cfg))


def run_closed(engine: Any, prompts: list[Any], concurrency: int, max_new: int, desc: str) -> dict[str, Any]:
    """``prompts`` through ``engine``, ``concurrency`` in flight: output tok/s, TTFT (from the request's add to its
    first token), how many finished, the peak of sequences running and of pages in use, the preemptions."""
    from dmtd.engine.sequence import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, exact=True)
    todo, tokens, done, peak_running = list(prompts), 0, 0, 0
    live: dict[str, float] = {}  # in flight → when it was added
    ttft: list[float] = []
    sch = engine.scheduler
    sch.pages.peak_used, preempted0 = sch.pages.num_used, sch.num_preempted
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc=desc, leave=False) as bar:
        while todo or live:
            while todo and len(live) < concurrency:
                added = time.perf_counter()
                live[engine.add_request(engine.encode(todo.pop(0)), params)] = added
            outs = engine.step()
            peak_running = max(peak_running, len(sch.running))
            for o in outs:
                if o.req_id not in live:
                    continue
                tokens += len(o.block or [])
                if o.token_id >= 0 and live[o.req_id] > 0:
                    ttft.append(time.perf_counter() - live[o.req_id])
                    live[o.req_id] = 0.0
                if o.finished:
                    live.pop(o.req_id)
                    done += o.finish_reason in ("stop", "length")
                    engine.release(o.req_id)
                    bar.update()
    wall = time.perf_counter() - t0
    ttft.sort()
    return {"requests": len(prompts), "finished": done, "output_tok_s": tokens / wall, "wall_s": wall,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
            "peak_running": peak_running, "peak_pages": sch.pages.peak_used, "pages": sch.pages.num_pages,
            "preempted": sch.num_preempted - preempted0}


def run_pool_bench(args: argparse.Namespace) -> dict[str, Any]:
    from dmtd.engine.kv_cache import bytes_per_position

    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "func"}}
    paged = _engine(args, max_num_seqs=args.concurrency, max_model_len=8192, kv_cache_tokens=args.kv_cache_tokens)
    slots = _engine(args, max_num_seqs=16, max_model_len=2048)  # one row of 2,048 positions a sequence, as before
    r = paged.runner
    per = bytes_per_position(r.model.config, r.dmtd, r.kv_dtype, r.act_dtype)
    result["kv_bytes_per_token"] = per
    result["pool_bytes"] = {"paged": per * paged.scheduler.pages.num_pages * paged.scheduler.pages.page_size,
                            "16 slots": per * 16 * 2048}
    prompts = [[{"role": "user", "content": CHATS[i % len(CHATS)] + f" (request {i})"}]
               for i in range(max(args.requests, args.burst))]
    warm = prompts[:2]
    rows = {}
    for name, e in (("paged, 64 sequences", paged), ("16 slots × 2,048", slots)):
        run_closed(e, warm, 2, 8, f"warm-up {name}")
        rows[name] = run_closed(e, prompts[: args.requests], args.concurrency, args.max_new_tokens, name)
    result["concurrency"] = rows
    result["burst"] = run_closed(paged, prompts[: args.burst], args.burst, args.max_new_tokens,
                                 f"burst of {args.burst}")
    long_req = chat(system_prompt(paged, 7, args.long_prompt - 40), CHATS[3])
    n_long = len(paged.encode(long_req))
    result["long"] = run_closed(paged, [long_req] + prompts[: args.concurrency - 1], args.concurrency,
                                args.max_new_tokens, f"{n_long} tokens beside {args.concurrency - 1}")
    result["long"]["long_prompt_tokens"] = n_long
    mib = 2**20
    print(f"\nKV bytes per position {per} (every layer's K and V in float32, the verifier's decoding group, the tail "
          f"path's stash); paged pool {result['pool_bytes']['paged'] / mib:.0f} MiB, 16 slots × 2,048 "
          f"{result['pool_bytes']['16 slots'] / mib:.0f} MiB")
    print(f"\n{args.requests} chat requests at c={args.concurrency}, {args.max_new_tokens} new tokens, exact profile, "
          f"{args.dtype}")
    print(f"{'':>22} {'tok/s':>7} {'TTFT mean':>10} {'p50':>7} {'finished':>9} {'peak running':>13} "
          f"{'peak pages':>11} {'preempted':>10}")
    for name, row in [*rows.items(), (f"burst of {args.burst}", result["burst"]),
                      (f"{n_long} tok + {args.concurrency - 1}", result["long"])]:
        print(f"{name:>22} {row['output_tok_s']:>7.1f} {row['ttft_mean_ms']:>8.0f}ms {row['ttft_p50_ms']:>5.0f}ms "
              f"{row['finished']:>4}/{row['requests']:<4} "
              f"{row['peak_running']:>13} {row['peak_pages']:>5}/{row['pages']:<5} {row['preempted']:>10}")
    a, b = rows["paged, 64 sequences"], rows["16 slots × 2,048"]
    print(f"\npaged / slots: {a['output_tok_s'] / b['output_tok_s']:.2f}× output tok/s")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return result
