"""``dmtd bench serve --against vllm``: the same workloads on vLLM's CPU build, as users run it, and on our OpenAI
endpoint.

One external client for both sides: vLLM's own ``vllm bench serve`` (greedy), from the venv
``scripts/install-vllm.sh`` makes under ``$DMTD_CACHE``. Our stack runs as ``dmtd serve`` starts it by default (the
shipped variant, its precision: bf16 where the kernels build; exact greedy requests: the base model's tokens).
``vllm serve`` runs on the converted SmolLM2 safetensors in each configuration of ``--vllm-configs`` in turn:

* ``default``: its defaults (on a CPU node its engine takes all cores but one, which it leaves to its API server);
* ``bind``: every core this process may run on bound to its engine (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0-1``);

both in ``--vllm-dtype`` (``auto``: bf16 where the CPU computes in bf16 natively, float32 where vLLM's bf16 is
emulated and slow). Every server binds 127.0.0.1 on a free port. Each workload (``dmtd.bench.vllm_workloads``) runs
on a vLLM configuration, then at once on ours; each row compares ours with the best configuration
(``dmtd.bench.vllm_rows``). EOS may end an answer (our OpenAI API has no ``ignore_eos``); each row keeps its output
tokens.

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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dmtd.bench.vllm_rows import format_table, make_rows
from dmtd.bench.vllm_workloads import (
    TWO_TURN,
    Render,
    chat_template,
    client_command,
    first_turns,
    turn_args,
    two_turn_prompts,
    workloads,
    write_dataset,
    write_prompts,
)
from dmtd.serve.settings import engine_default

AGAINST = ("vllm",)
WORKLOADS = ("chat", "prefix", "two-turn")  # --vllm-workloads
CONFIGS = ("default", "bind")  # how vLLM runs: its defaults; every core bound to its engine
KVCACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE: fits a 24 GiB machine beside our stack's idle processes
DETAIL_DROPPED = ("generated_texts", "itls", "errors")


class AnchorError(RuntimeError):
    """vLLM or its client did not run; the message says what and where its log is."""


def vllm_venv() -> Path:
    from dmtd.variants.smollm2 import cache_dir

    return Path(os.environ.get("VLLM_VENV") or cache_dir() / "vllm-cpu")


def check_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The concurrencies and vLLM configurations of a valid ``--against`` run; a bad combination exits with code 2,
    naming the option."""
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
    if getattr(args, "load_format", "auto") == "dummy" and not args.model:
        raise usage("--load-format dummy needs --model: a folder with a config.json (dmtd shapes export)")
    try:
        conc = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        raise usage(f"--concurrency: {args.concurrency!r} is not a comma-separated list of integers") from None
    if not conc or min(conc) < 1:
        raise usage(f"--concurrency: {args.concurrency!r} needs positive integers")
    if args.max_new_tokens < 1:
        raise usage("--max-new-tokens must be at least 1")
    configs = [c for c in getattr(args, "vllm_configs", ",".join(CONFIGS)).split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs or len(set(configs)) < len(configs):
        raise usage(f"--vllm-configs: {getattr(args, 'vllm_configs', '')!r} must name each of "
                    f"{', '.join(CONFIGS)} at most once, at least one")
    chosen = [w for w in getattr(args, "vllm_workloads", ",".join(WORKLOADS)).split(",") if w]
    if not chosen or any(w not in WORKLOADS for w in chosen) or len(set(chosen)) < len(chosen):
        raise usage(f"--vllm-workloads: {getattr(args, 'vllm_workloads', '')!r} must name each of "
                    f"{', '.join(WORKLOADS)} at most once, at least one")
    return conc, configs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_list(cpus: Iterable[int]) -> str:
    """CPU ids as a cpu list, ranges joined (``{0, 1}`` → ``0-1``, ``{0, 1, 2, 5}`` → ``0-2,5``)."""
    ids, parts = sorted(set(cpus)), []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def vllm_env(config: str = "default", cpus: Iterable[int] | None = None) -> dict[str, str]:
    """The environment of ``vllm serve`` and its client in ``config``: ``default`` leaves the core binding to vLLM,
    ``bind`` binds its engine to ``cpus`` (default: every CPU this process may run on)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if config == "bind":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(os.sched_getaffinity(0) if cpus is None else cpus)
    return env


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


def serve_command(venv: Path, model_dir: str, port: int, name: str, dtype: str, load_format: str = "auto"
                  ) -> list[str]:
    """``vllm serve`` in ``dtype``, its defaults otherwise, on 127.0.0.1:port, a sequence's length capped as ours is
    (``dmtd serve --max-model-len``'s default: a Qwen3 config's 40,960 positions do not fit vLLM's 4 GiB pool)."""
    return [str(venv / "bin" / "vllm"), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--served-model-name", name, "--max-model-len", str(engine_default("max_model_len")),
            *(["--load-format", load_format]
                                                             if load_format != "auto" else [])]


def start_vllm(venv: Path, model_dir: str, port: int, name: str, log: Path, dtype: str = "bfloat16",
               config: str = "default", timeout_s: float = 900.0, load_format: str = "auto") -> subprocess.Popen:
    """``vllm serve`` (``serve_command``) in ``config``'s environment, in its own session; returns once /health
    answers."""
    cmd = serve_command(venv, model_dir, port, name, dtype, load_format)
    env = vllm_env(config)
    print(f"$ VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND', '(default)')} " + " ".join(cmd),
          flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
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


def run_one(venv: Path, base_url: str, model: str, tokenizer: str, w: dict[str, Any], workdir: Path,
            side: str, warmups: int = 1) -> dict[str, Any]:
    """One workload against one server, as ``vllm bench serve`` saved it (``--save-detailed``: each request's TTFT,
    token counts and text); a failed request fails the run."""
    result = workdir / f"{side}-{w['workload']}-n{w['concurrency']}.json"
    log = result.with_suffix(".log")
    cmd = client_command(venv, base_url, model, tokenizer, w, result, warmups=warmups)
    print(f"[{side}] {w['workload']} N={w['concurrency']} ({w['num_prompts']} requests) ...", flush=True)
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=vllm_env(), stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not result.is_file():
        raise AnchorError(f"vllm bench serve against {side} failed ({rc}; log {log}):\n{_tail(log)}")
    raw: dict[str, Any] = json.loads(result.read_text())
    if raw.get("failed"):
        errs = [e for e in raw.get("errors", []) if e][:2]
        raise AnchorError(f"{raw['failed']} of {w['num_prompts']} requests to {side} failed (log {log}): {errs}")
    return raw


def run_two_turn(venv: Path, base_url: str, model: str, tokenizer: str, w: dict[str, Any], workdir: Path,
                 side: str, render: Render, firsts: list[str]) -> dict[str, Any]:
    """Every conversation's first turn, then every second turn with that server's own first answer in its history;
    the second turns' result, the first's under ``turn1``."""
    turn = {**w, "completions": True, "num_prompts": len(firsts)}
    p1 = write_prompts(workdir / f"{side}-turn1.jsonl", two_turn_prompts(firsts, None, render))
    t1 = run_one(venv, base_url, model, tokenizer, {**turn, "workload": "turn1",
                                                     "dataset_args": turn_args(p1, w["max_new_tokens"])},
                 workdir, side)
    answers = [str(t) for t in t1.get("generated_texts") or []]
    if len(answers) != len(firsts):
        raise AnchorError(f"the first turns against {side} saved {len(answers)} answers for {len(firsts)} "
                          f"conversations (workdir {workdir})")
    p2 = write_prompts(workdir / f"{side}-turn2.jsonl", two_turn_prompts(firsts, answers, render))
    # no warm-up request: it would be a second turn, whose answer the measured one could then read from the cache
    t2 = run_one(venv, base_url, model, tokenizer, {**turn, "workload": "turn2",
                                                     "dataset_args": turn_args(p2, w["max_new_tokens"])},
                 workdir, side, warmups=0)
    return {**_kept(t2), "turn1": _kept(t1)}


def _kept(raw: dict[str, Any]) -> dict[str, Any]:
    """Per request, TTFT and token counts kept; the texts and every chunk's gap stay in the workdir's files."""
    return {k: v for k, v in raw.items() if k not in DETAIL_DROPPED}


def start_ours(args: argparse.Namespace, variant: str, max_conc: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our stack as ``dmtd serve`` starts it by default (its parser's defaults), on free loopback ports."""
    from dmtd.serve.local import add_serve_args, start_stack
    from dmtd.variants.build import variant_precision

    p = argparse.ArgumentParser()
    add_serve_args(p)
    ns = p.parse_args([])
    ns.host, ns.grpc_port, ns.http_port, ns.metrics_port = "127.0.0.1", free_port(), free_port(), free_port()
    ns.model, ns.decoding_layers = args.model, args.decoding_layers
    ns.kv_cache_gib = getattr(args, "kv_cache_gib", None) or ns.kv_cache_gib
    ns.kv_cache_dtype = getattr(args, "kv_cache_dtype", None) or ns.kv_cache_dtype
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
    conc, configs = check_args(args)
    venv = vllm_venv()
    if not (venv / "bin" / "vllm").is_file():
        print(f"error: --against vllm needs vLLM's CPU build in {venv}: run `make bench-deps` "
              "(scripts/install-vllm.sh)", file=sys.stderr)
        raise SystemExit(2)
    from dmtd.serve.local import stop_stack
    from dmtd.serve.netns import isolate_network
    from dmtd.variants.smollm2 import smollm2_dir

    model_dir = str(args.model or smollm2_dir())
    load_format = getattr(args, "load_format", "auto")
    if load_format != "auto":  # our stack's replicas read it from the environment, as `dmtd serve --load-format`
        from dmtd.variants.loader import LOAD_FORMAT_ENV

        os.environ[LOAD_FORMAT_ENV] = load_format
    isolate_network()  # every server and the client on loopback, in a namespace of this process's own
    workdir = Path(tempfile.mkdtemp(prefix="dmtd-vs-vllm-"))
    chosen = getattr(args, "vllm_workloads", ",".join(WORKLOADS)).split(",")
    plan = workloads(conc if "chat" in chosen else [], args.requests_per_worker, args.max_new_tokens,
                     write_dataset(workdir / "chats.jsonl"), prefix="prefix" in chosen, two_turn="two-turn" in chosen)
    render, firsts = chat_template(model_dir), first_turns(TWO_TURN["conversations"])
    dtype = vllm_dtype(args.vllm_dtype)
    print(f"vllm serve in {dtype} (--vllm-dtype {args.vllm_dtype}), configurations {', '.join(configs)}", flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"vllm": {}, "dmtd": {}}

    def run(side: str, url: str, model: str, w: dict[str, Any]) -> dict[str, Any]:
        if w["workload"] == "two-turn":
            return run_two_turn(venv, url, model, model_dir, w, workdir, side, render, firsts)
        return _kept(run_one(venv, url, model, model_dir, w, workdir, side))

    def on_vllm(c: str, each: Callable[[str], None]) -> None:
        port = free_port()
        proc = start_vllm(venv, model_dir, port, "smollm2", workdir / f"vllm-serve-{c}.log", dtype, c,
                          load_format=load_format)
        try:
            each(f"http://127.0.0.1:{port}")
        finally:
            stop_process(proc)

    alone = getattr(args, "one_server_at_a_time", False)
    info, ours = start_ours(args, args.variant or default_variant, max(w["concurrency"] for w in plan))
    try:
        if alone:  # ours first, alone in memory; every configuration's rows compare with these runs
            mine = [run("dmtd", info["http"], info["variant"], w) for w in plan]
            results["dmtd"] = {c: mine for c in configs}
        else:
            for c in configs:
                # each workload on vLLM then on ours right after: on a shared machine, a drift of its speed falls
                # between workloads rather than between the two sides of one row
                def both(url: str, c: str = c) -> None:
                    for w in plan:
                        results["vllm"].setdefault(c, []).append(run(f"vllm-{c}", url, "smollm2", w))
                        results["dmtd"].setdefault(c, []).append(run(f"dmtd-{c}", info["http"], info["variant"], w))

                on_vllm(c, both)
    finally:
        stop_stack()
    if alone:
        for c in configs:
            def every(url: str, c: str = c) -> None:
                results["vllm"][c] = [run(f"vllm-{c}", url, "smollm2", w) for w in plan]

            on_vllm(c, every)
    rows = make_rows(results, plan)
    result = {"against": "vllm", "vllm_version": vllm_version(venv), "model_dir": model_dir, "load_format": load_format,
              "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "client": "vllm bench serve (openai-chat on "
              "/v1/chat/completions; the two-turn workload's turns openai on /v1/completions)",
              "vllm_serve": {"dtype": dtype, "configs": {c: {k: v for k, v in vllm_env(c).items()
                                                           if k.startswith("VLLM_CPU_")} for c in configs}},
              "dmtd": ours, "one_server_at_a_time": alone, "workloads": plan, "rows": rows, "workdir": str(workdir),
              "raw": results}
    print("\n" + format_table(rows))
    print("(ms; tok/s of output tokens; *: the best vLLM configuration, which ours is compared with; dmtd/best: above "
          "1 is faster for tok/s, below 1 for latencies; ITL is per streamed chunk, TPOT per output token; two-turn: "
          "the second turns)")
    if args.json_path:
        from dmtd.bench.results import write_json

        write_json(args.json_path, result)
    return result
