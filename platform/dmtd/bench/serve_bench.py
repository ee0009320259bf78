"""``dmtd bench serve``: a load generator over real gRPC against a local stack, comparing τ policies.

Policies run on the same stack, one after another: fixed τ=1 and fixed τ=3 (request bounds pin τ; the
variant's confidence gate stays on) and adaptive (the replica's controller decides). Closed loop: N
workers send back-to-back requests. Open loop: Poisson arrivals at a given rate.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
import uuid
from typing import Any

from tqdm import tqdm

from dmtd.bench.results import write_json
from dmtd.bench.serve_report import plot, print_tables
from dmtd.bench.serve_stages import collect_stages, cpu_per_token, cpu_snapshot
from dmtd.bench.vllm_anchor import AGAINST, CONFIGS
from dmtd_contract.stats import percentile

# τ bounds (0: the controller's) and the profile a policy's requests name ("": the variant's default, the exact
# profile for the shipped variant; "adaptive" is the proto's name of the unverified DMTD profile)
POLICIES = {"tau1": (1, 1, ""), "tau3": (3, 3, ""), "adaptive": (0, 0, ""), "exact": (0, 0, "exact"),
            "dmtd": (0, 0, "adaptive")}
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how vaccines work.",
           "List five tips for learning a new language.", "Describe the water cycle.",
           "What are the benefits of regular exercise?", "Write a poem about the sea.",
           "How does a bicycle stay upright?", "Give me a recipe for pancakes."]


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=None, help="bench a running gateway instead of starting a stack")
    p.add_argument("--variant", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--decoding-layers", type=int, default=None)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rate", type=float, default=0.0, help="open-loop Poisson arrivals per second (0 = skip)")
    p.add_argument("--open-requests", type=int, default=24, help="requests per open-loop run")
    p.add_argument("--policies", default="tau1,tau3,adaptive",
                   help="of tau1, tau3, adaptive (the controller's τ, the variant's default profile), exact, dmtd "
                        "(the controller's τ, the unverified DMTD profile)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests-per-worker", type=int, default=3)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=50.0)
    p.add_argument("--grpc-port", type=int, default=0)
    p.add_argument("--block-push", default=None, metavar="auto|off|ADDRESS",
                   help="replicas push blocks straight to a TCP sink of the gateway (default auto: on loopback when "
                   "the gateway is); off: blocks travel as items of the Serve call, gathered by --stream-interval-ms")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="the started stack's stream interval (default: the server's, 40 ms; 0: every block alone)")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--repeats", type=int, default=1,
                   help="closed-loop runs per row (stack and engine in turn); the row is the best one of each")
    p.add_argument("--dtypes", default=None, metavar="LIST",
                   help="replicas' precisions to compare in one run, e.g. auto,float32: a stack per precision, one "
                        "after another, the same workload, then each row's tok/s against the last precision's")
    p.add_argument("--against", default=None, choices=AGAINST,
                   help="the same workload on vLLM's CPU build (`make bench-deps`) and on our OpenAI endpoint, one "
                        "client for both (vllm bench serve): vLLM as users run it (--vllm-configs); chat, "
                        "shared-prefix and two-turn workloads; ours against the best configuration "
                        "(dmtd.bench.vllm_anchor)")
    p.add_argument("--vllm-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="--against vllm: the precision vLLM serves in; auto: bfloat16 on a CPU with native bf16 "
                        "(avx512_bf16 or amx_bf16), float32 elsewhere, where vLLM's bf16 is emulated and slower")
    p.add_argument("--vllm-workloads", default="chat,prefix,two-turn", metavar="LIST",
                   help="--against vllm: which workloads run (chat at each --concurrency; prefix: shared 1,024-token "
                        "prefixes; two-turn: conversations whose second turn carries the first answer)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="--against vllm: our replica's KV pool in GiB (dmtd serve --kv-cache-gib; default: dmtd "
                        "serve's own), e.g. 4 to match the pool vLLM gets here (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16"), default=None,
                   help="--against vllm: our replica's KV cache element (dmtd serve --kv-cache-dtype; default: dmtd "
                        "serve's own, auto)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="--against vllm: 'dummy' runs --model's config with seeded random weights on both sides (ours: "
                        "dmtd serve --load-format dummy; vLLM: its --load-format dummy), a shape from `dmtd shapes "
                        "export` (docs/shapes.md); use with --variant none")
    p.add_argument("--vllm-configs", default=",".join(CONFIGS), metavar="LIST",
                   help="--against vllm: how vLLM runs, one after another, ours compared with the best: default (its "
                        "defaults: all cores but one to its engine) and bind (every core bound to its engine, "
                        "VLLM_CPU_OMP_THREADS_BIND)")
    p.add_argument("--one-server-at-a-time", action="store_true",
                   help="--against vllm: our stack runs every workload and stops, then each vLLM configuration "
                        "(default: both servers up, each workload on vLLM then at once on ours); for shapes whose "
                        "two servers do not fit the memory together (a 1.7B shape's weights and KV pools on 24 GiB)")
    p.add_argument("--compare-engine", action="store_true",
                   help="also run each closed-loop workload on an in-process engine (same variant, prompts, "
                        "tokens, τ policy): rows gain engine_tokens_per_s, stack_efficiency (best stack run over best "
                        "engine run), stack_efficiency_paired (median over the repeats of each stack run over the "
                        "engine run beside it; the pairs alternate which runs first) and engine TTFT; at N > 1 also "
                        "the same requests on the engine in static batches of N (engine_static_tokens_per_s, "
                        "arrivals_over_static: what interleaving prefill with decode costs). This host's "
                        "speed drifts by 10-20 %% within seconds: short runs and many repeats pair best, e.g. "
                        "--requests-per-worker 2 --repeats 12")


def _record(t0: float, arrivals: list[tuple[float, int]]) -> dict[str, Any]:
    """One request's client-side record from its blocks' arrival times and token counts."""
    itl: list[float] = []
    for (prev, _), (now, k) in zip(arrivals, arrivals[1:], strict=False):
        if k:
            itl.extend([(now - prev) * 1e3 / k] * k)
    first, last = (arrivals[0][0], arrivals[-1][0]) if arrivals else (t0, t0)
    return {"ttft_ms": (first - t0) * 1e3, "e2e_ms": (last - t0) * 1e3, "tokens": sum(k for _, k in arrivals),
            "itl_ms": itl}


def _request_kwargs(i: int, policy: str, max_new: int, request_id: str) -> dict[str, Any]:
    lo, hi, profile = POLICIES[policy]
    return {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_new_tokens": max_new,
            "ignore_eos": True, "tau_min": lo, "tau_max": hi, "profile": profile, "request_id": request_id}


def one_request(target: Any, i: int, policy: str, max_new: int, request_id: str = "") -> dict[str, Any]:
    """One streamed chat request; ``target`` is a gateway address or an open ``DMTDClient`` (its channel is
    reused, as a real client's is: no connection set-up in the request's TTFT)."""
    from dmtd.client import DMTDClient

    if isinstance(target, str):
        with DMTDClient(target) as c:
            return one_request(c, i, policy, max_new, request_id)
    t0 = time.perf_counter()
    arrivals = [(time.perf_counter(), b.k) for b in target.generate(**_request_kwargs(i, policy, max_new, request_id))]
    return _record(t0, arrivals)


async def one_request_async(client: Any, i: int, policy: str, max_new: int, request_id: str = "") -> dict[str, Any]:
    """``one_request`` on an open ``AsyncDMTDClient``."""
    t0 = time.perf_counter()
    arrivals = [(time.perf_counter(), b.k)
                async for b in client.generate(**_request_kwargs(i, policy, max_new, request_id))]
    return _record(t0, arrivals)


def summarize(results: list[dict[str, Any]], wall_s: float, ttft_slo: float, itl_slo: float) -> dict[str, Any]:
    itl = [x for r in results for x in r["itl_ms"]]
    ok = [r for r in results if r["ttft_ms"] <= ttft_slo and percentile(r["itl_ms"], 0.95) <= itl_slo]
    return {"requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall_s, "wall_s": wall_s,
            "ttft_p50_ms": percentile([r["ttft_ms"] for r in results], 0.5),
            "ttft_p95_ms": percentile([r["ttft_ms"] for r in results], 0.95),
            "itl_p50_ms": percentile(itl, 0.5), "itl_p95_ms": percentile(itl, 0.95),
            "e2e_p50_ms": percentile([r["e2e_ms"] for r in results], 0.5),
            "e2e_p95_ms": percentile([r["e2e_ms"] for r in results], 0.95),
            "slo_attainment": len(ok) / len(results) if results else 0.0}


def engine_columns(row: dict[str, Any], e: dict[str, Any]) -> dict[str, Any]:
    """What a stack row gains from the same workload on the in-process engine (``--compare-engine``)."""
    return {"engine_tokens_per_s": e["tokens_per_s"], "stack_efficiency": row["tokens_per_s"] / e["tokens_per_s"],
            "engine_ttft_p50_ms": e["ttft_p50_ms"], "engine_ttft_p95_ms": e["ttft_p95_ms"],
            "engine_itl_p50_ms": e["itl_p50_ms"], "engine_itl_p95_ms": e["itl_p95_ms"], "engine": e}


def closed_loop(target: str, policy: str, n: int, per_worker: int, max_new: int,
                tag: str = "") -> tuple[list, float]:
    """N workers × ``per_worker`` back-to-back requests; with ``tag``, request ids are ``{tag}-{i}``.

    The workers are coroutines on one event loop, each with its own channel (as N separate clients have),
    connected before the clock starts. The load generator shares this machine with the stack it measures:
    on asyncio it takes ~half the CPU per token that one thread per worker took (blocking gRPC channels each
    spin a polling thread while a stream is open)."""
    return asyncio.run(_closed_loop(target, policy, n, per_worker, max_new, tag))


async def _closed_loop(target: str, policy: str, n: int, per_worker: int, max_new: int,
                       tag: str) -> tuple[list, float]:
    from dmtd.client import AsyncDMTDClient

    clients = [AsyncDMTDClient(target) for _ in range(n)]
    try:
        await asyncio.gather(*(c.list_variants() for c in clients))

        async def worker(w: int, c: Any) -> list[dict[str, Any]]:
            return [await one_request_async(c, w * 100 + j, policy, max_new, f"{tag}-{w * 100 + j}" if tag else "")
                    for j in range(per_worker)]

        t0 = time.perf_counter()
        per = await asyncio.gather(*(worker(w, c) for w, c in enumerate(clients)))
        return [r for rs in per for r in rs], time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def open_loop(target: str, policy: str, rate: float, count: int, max_new: int, seed: int = 0) -> tuple[list, float]:
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def fire(i: int) -> None:
        r = one_request(target, i, policy, max_new)
        with lock:
            results.append(r)

    t0 = time.perf_counter()
    threads = []
    for i in range(count):
        threads.append(threading.Thread(target=fire, args=(i,)))
        threads[-1].start()
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def _engine_run(engine: Any, cfg: Any, ctl: Any, policy: str, n: int, args: argparse.Namespace,
                static: bool = False) -> dict[str, Any]:
    """One closed-loop run of ``--compare-engine``'s in-process engine: the stack row's workload, summarised the
    same way, with its CPU and step time per token (``static``: the same requests in static batches of n)."""
    from dmtd.bench.engine_compare import engine_closed_loop

    c0 = cpu_snapshot()["client"]
    eres, ewall = engine_closed_loop(engine, cfg, POLICIES[policy], n, args.requests_per_worker, args.max_new_tokens,
                                     PROMPTS, ctl, static=static)
    e = summarize(eres, ewall, args.ttft_slo_ms, args.itl_slo_ms)
    e["cpu_ms_per_token"] = (cpu_snapshot()["client"] - c0) * 1e3 / max(e["tokens"], 1)
    for k in ("step_ms", "step_cpu_ms"):  # the stack's engine_step / engine_step_cpu stages
        e[f"{k}_per_token"] = sum(x[k] for x in eres) / max(e["tokens"], 1)
    return e


def run_bench_serve(args: argparse.Namespace, default_variant: str) -> dict[str, Any]:
    if getattr(args, "against", None) is None:
        for opt, default in (("vllm_dtype", "auto"), ("vllm_configs", ",".join(CONFIGS)),
                             ("one_server_at_a_time", False)):
            if getattr(args, opt, default) != default:
                print(f"error: --{opt.replace('_', '-')} sets how --against vllm runs vLLM: add --against vllm",
                      file=sys.stderr)
                raise SystemExit(2)
    if getattr(args, "against", None) is not None:
        from dmtd.bench.vllm_anchor import run_against

        return run_against(args, default_variant)
    dtypes = [d for d in (getattr(args, "dtypes", None) or "").split(",") if d]
    if len(dtypes) > 1:
        return compare_dtypes(args, default_variant, dtypes)
    return _run_bench_serve(args, default_variant, dtypes[0] if dtypes else None)


def compare_dtypes(args: argparse.Namespace, default_variant: str, dtypes: list[str]) -> dict[str, Any]:
    """The same bench on a stack per precision, one after another in this process; each row's tok/s and TTFT
    against the last precision's (``--dtypes auto,float32``: today's default against float32)."""
    if args.server is not None:
        raise ValueError("--dtypes starts a stack per precision: it cannot bench a running --server")
    runs = {}
    for d in dtypes:
        print(f"\n=== replicas' dtype: {d} ===")
        runs[d] = _run_bench_serve(argparse.Namespace(**{**vars(args), "json_path": None}), default_variant, d)
    ref = runs[dtypes[-1]]["rows"]
    print(f"\n{'N':>4} {'policy':>9} " + " ".join(f"{d + ' tok/s':>15}" for d in dtypes)
          + " " + " ".join(f"{'×' + dtypes[-1]:>10}" for d in dtypes[:-1]) + f" {'TTFT p50 ms':>12}")
    for i, r in enumerate(ref):
        vals = [runs[d]["rows"][i]["tokens_per_s"] for d in dtypes]
        ttft = "/".join(f"{runs[d]['rows'][i]['ttft_p50_ms']:.0f}" for d in dtypes)
        print(f"{r.get('concurrency', r.get('rate')):>4} {r['policy']:>9} " + " ".join(f"{v:>15.1f}" for v in vals)
              + " " + " ".join(f"{v / vals[-1]:>10.2f}" for v in vals[:-1]) + f" {ttft:>12}")
    result = {"dtypes": dtypes, "runs": runs}
    if args.json_path:
        write_json(args.json_path, result)
    return result


def _run_bench_serve(args: argparse.Namespace, default_variant: str, dtype: str | None) -> dict[str, Any]:
    from dmtd.serve.local import start_stack, stop_stack

    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    policies = [p for p in args.policies.split(",") if p]
    started = args.server is None
    if started:
        from dmtd.serve.netns import isolate_network

        isolate_network()
        ns = argparse.Namespace(host="127.0.0.1", grpc_port=args.grpc_port or 19000, http_port=18000, registry=None,
                                model=args.model, decoding_layers=args.decoding_layers, replicas=1,
                                max_num_seqs=max(concurrency), itl_slo_ms=args.itl_slo_ms,
                                stream_interval_ms=args.stream_interval_ms, block_push=args.block_push, dtype=dtype)
        info = start_stack(ns, args.variant or default_variant)
        target = info["grpc"]
    else:
        target = args.server
    rows = []
    engine: Any = None
    if args.compare_engine:
        from dmtd.bench.engine_compare import build_local_engine, engine_closed_loop

        engine, engine_cfg = build_local_engine(args.variant or default_variant, args.model, args.decoding_layers,
                                                max(concurrency), args.itl_slo_ms)
        from dmtd.serve.controller import TauController

        engine_ctl = TauController(engine_cfg)  # one for the whole bench, like the replica's
        engine_closed_loop(engine, engine_cfg, POLICIES["tau1"], 1, 1, 8, PROMPTS, engine_ctl)  # warm-up
    try:
        one_request(target, 0, "tau1", 8)  # warm-up
        jobs = [(p, n) for n in concurrency for p in policies]
        if args.rate > 0:
            jobs += [(p, -1) for p in policies]
        for policy, n in tqdm(jobs, desc="bench serve", unit="run"):
            tries: list[dict[str, Any]] = []
            engine_tries: list[dict[str, Any]] = []
            static_tries: list[dict[str, Any]] = []
            # stack and engine in turn, R times each; the pairs alternate which goes first (stack then engine,
            # engine then stack, …), so that a machine whose speed drifts within a pair favours neither side
            for rep in range(max(1, args.repeats) if n > 0 else 1):
                if engine is not None and n > 0 and rep % 2 == 1:
                    engine_tries.append(_engine_run(engine, engine_cfg, engine_ctl, policy, n, args))
                tag = f"bench-{policy}-n{n}-{uuid.uuid4().hex[:8]}"
                if n > 0:
                    cpu0 = cpu_snapshot() if started else None
                    res, wall = closed_loop(target, policy, n, args.requests_per_worker, args.max_new_tokens, tag)
                    cpu1 = cpu_snapshot() if started else None
                    mode = {"mode": "closed", "concurrency": n}
                else:
                    res, wall = open_loop(target, policy, args.rate, args.open_requests, args.max_new_tokens)
                    mode = {"mode": "open", "rate": args.rate}
                t = {"policy": policy, **mode, **summarize(res, wall, args.ttft_slo_ms, args.itl_slo_ms)}
                if started and n > 0:
                    t["stages"] = collect_stages("dmtd", tag, len(res))
                    if cpu0 and cpu1:
                        t["cpu_ms_per_token"] = cpu_per_token(cpu0, cpu1, t["tokens"])
                tries.append(t)
                if engine is not None and n > 0 and rep % 2 == 0:
                    engine_tries.append(_engine_run(engine, engine_cfg, engine_ctl, policy, n, args))
                if engine is not None and n > 1:  # the same requests in static batches, right after
                    static_tries.append(_engine_run(engine, engine_cfg, engine_ctl, policy, n, args, static=True))
            row = max(tries, key=lambda r: r["tokens_per_s"])  # best of the repeats, as bench engine reports
            if len(tries) > 1:
                row["repeats_tokens_per_s"] = [r["tokens_per_s"] for r in tries]
            if engine_tries:
                row.update(engine_columns(row, max(engine_tries, key=lambda r: r["tokens_per_s"])))
                if len(engine_tries) > 1:
                    row["repeats_engine_tokens_per_s"] = [r["tokens_per_s"] for r in engine_tries]
                # each stack run and the engine run right after it, as a pair: a drift of the machine's speed
                # between repeats cancels within a pair, where the ratio of the bests compares different times
                pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(tries, engine_tries, strict=True)]
                row["stack_efficiency_pairs"] = pairs
                row["stack_efficiency_paired"] = statistics.median(pairs)
            if static_tries:  # the engine under arrivals over the same engine in static batches of n
                best_static = max(static_tries, key=lambda r: r["tokens_per_s"])
                row["engine_static_tokens_per_s"] = best_static["tokens_per_s"]
                row["arrivals_over_static"] = row["engine_tokens_per_s"] / best_static["tokens_per_s"]
                row["arrivals_over_static_paired"] = statistics.median(
                    a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(engine_tries, static_tries, strict=True))
            rows.append(row)
    finally:
        if started:
            stop_stack()
    for r in rows:
        base = next((b for b in rows if b["policy"] == "tau1" and b["mode"] == r["mode"]
                     and b.get("concurrency") == r.get("concurrency")), None)
        if base:
            r["speedup_vs_tau1"] = r["tokens_per_s"] / base["tokens_per_s"]
    result = {"target": target, "variant": args.variant or default_variant, "dtype": dtype or "default",
              "max_new_tokens": args.max_new_tokens,
              "ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms,
              "requests_per_worker": args.requests_per_worker, "rows": rows}
    if started:
        from dmtd.serve.settings import serve_config

        given = {"stream_interval_ms": args.stream_interval_ms, "block_push": args.block_push}
        cfg = serve_config({k: v for k, v in given.items() if v is not None})  # as start_stack read them
        result["stream_interval_ms"], result["block_push"] = cfg.stream_interval_ms, cfg.block_push
    staged = print_tables(rows)
    if args.json_path:
        path = write_json(args.json_path, result)
        plot(result, path.with_suffix(".png"))
        written = [path.with_suffix(".png")]
        if staged:
            from dmtd.bench.serve_stages import plot_stages

            written.append(path.with_name(path.stem + "_stages.png"))
            plot_stages(staged, written[-1], f"dmtd bench serve — variant {result['variant']}: stages per token")
        print("wrote " + ", ".join(map(str, written)))
    return result
