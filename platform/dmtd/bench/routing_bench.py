"""``dmtd bench routing``: two replicas behind the gateway, shared system prompts, prefix-aware routing against
Serve's default (power of two choices), one after the other in one run: each request's replica, TTFT and cached
prompt tokens (from its usage), over real gRPC in a private network namespace.

Routing pays only where one replica cannot keep every shared prefix: a replica's KV pool (``--kv-cache-tokens``)
is sized below the prefixes' total, as a real deployment's tenants outgrow one pod's KV memory (llm-d's 150
tenants × 6k tokens); with a pool that holds them all, random routing hits as often, once each replica has seen
each prefix."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm


def add_routing_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default=None, help="variant to serve (default: the shipped one)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=6, help="per replica: sequences at once")
    p.add_argument("--kv-cache-tokens", type=int, default=6144,
                   help="per replica: its KV pool's positions, running sequences and cached prefixes together "
                   "(default: 6 of the 8 system prompts; 0: the serving default, which holds them all)")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-chars", type=int, default=3400,
                   help="characters of each system prompt (~1,050 tokens: 1,024 of them whole prefill chunks)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--routings", default="prefix,pow2")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def system_prompts(n: int, chars: int) -> list[str]:
    out = []
    for p in range(n):
        lines: list[str] = []
        i = 0
        while len(" ".join(lines)) < chars:
            lines.append(f"Tenant {p} rule {i}: answer questions on topic {i * 11 + p} politely, in plain words.")
            i += 1
        out.append(" ".join(lines))
    return out


def one(target: str, system: str, question: str, max_new: int) -> dict[str, Any]:
    from dmtd.client import DMTDClient

    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    t0 = time.perf_counter()
    first = None
    with DMTDClient(target) as c:
        for b in c.generate(messages=msgs, max_new_tokens=max_new, timeout_s=600):
            first = first or time.perf_counter()
            last = b
    return {"replica": last.replica, "ttft_s": (first or time.perf_counter()) - t0,
            "prompt_tokens": last.usage.prompt_tokens, "cached_tokens": last.usage.cached_tokens,
            "tokens": last.usage.completion_tokens}


def route_decisions(metrics_url: str) -> dict[str, int]:
    """The gateway's routing decisions by reason, read from its Prometheus endpoint (empty if it cannot be read)."""
    import re
    import urllib.request

    try:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return {}
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("dmtd_route_decisions_total{") and (m := re.search(r'reason="([^"]*)"', line)):
            out[m.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return dict(out)


def run_routing(args: argparse.Namespace, routing: str, variant: str, jobs: list[tuple[str, str]]) -> dict[str, Any]:
    from dmtd.serve.local import start_stack, stop_stack

    ns = argparse.Namespace(host="127.0.0.1", grpc_port=19100, http_port=18100, registry=None, model=None,
                            decoding_layers=None, replicas=args.replicas, max_num_seqs=args.max_num_seqs,
                            kv_cache_tokens=args.kv_cache_tokens or None,
                            itl_slo_ms=5000.0, stream_interval_ms=None, block_push=None, dtype=None, routing=routing)
    info = start_stack(ns, variant)
    try:
        one(info["grpc"], "You are helpful.", "Say hi.", 4)  # warm-up (each replica warmed up before ready)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            res = list(tqdm(pool.map(lambda j: one(info["grpc"], j[0], j[1], args.max_new_tokens), jobs),
                            total=len(jobs), desc=f"bench routing ({routing})", unit="req"))
        wall = time.perf_counter() - t0
        decisions = route_decisions(info["metrics"][0]) if info.get("metrics") else {}
    finally:
        stop_stack()
    share = Counter(r["replica"] for r in res)
    ttft = sorted(r["ttft_s"] for r in res)
    hit = sum(r["cached_tokens"] for r in res) / sum(r["prompt_tokens"] for r in res)
    return {"routing": routing, "hit_ratio": hit,
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
            "output_tok_s": sum(r["tokens"] for r in res) / wall,
            "max_replica_share": max(share.values()) / len(res), "replicas": dict(share), "wall_s": wall,
            "decisions": decisions}


def run_routing_bench(args: argparse.Namespace, default_variant: str) -> dict[str, Any]:
    from dmtd.serve.netns import isolate_network

    isolate_network()
    systems = system_prompts(args.prefixes, args.prefix_chars)
    rng = random.Random(0)
    jobs = [(systems[rng.randrange(args.prefixes)], f"Question {i}: name something {i % 17} people enjoy.")
            for i in range(args.requests)]
    rows = [run_routing(args, r, args.variant or default_variant, jobs) for r in args.routings.split(",") if r]
    pool = f"a pool of {args.kv_cache_tokens} positions" if args.kv_cache_tokens else "the default pool"
    print(f"\n{args.replicas} replicas × {args.max_num_seqs} sequences and {pool}, {args.prefixes} system prompts × "
          f"~{args.prefix_chars} characters, {args.requests} requests at c={args.concurrency}")
    print(f"{'routing':>8} {'hit ratio':>9} {'TTFT p50':>9} {'TTFT mean':>10} {'TTFT p90':>9} {'tok/s':>7} "
          f"{'top share':>9}  decisions")
    for r in rows:
        print(f"{r['routing']:>8} {r['hit_ratio']:>9.2f} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_mean_ms']:>8.0f}ms "
              f"{r['ttft_p90_ms']:>7.0f}ms {r['output_tok_s']:>7.1f} {100 * r['max_replica_share']:>8.0f}%  "
              + " ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()) if v))
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return result
