"""``dmtd bench ready``: ready means warm. Starts ``dmtd serve`` as a new user does (a subprocess, its defaults,
loopback ports), waits until it says it is serving, then sends chat requests one after another through the OpenAI
endpoint (streamed, greedy): the first request's time to first token against the median of the next ones."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from dmtd.bench.exact_bench import CHATS


def add_ready_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=6, help="chat requests after ready, one at a time")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--http-port", type=int, default=18431)
    p.add_argument("--grpc-port", type=int, default=19431)
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long the stack may take to say it serves")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def _ttft(url: str, model: str, question: str, max_tokens: int) -> float:
    """Seconds from sending a streamed chat request to its first content delta."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                       "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {") and '"content"' in line:
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream carried no content")
    return first


def run_ready_bench(args: argparse.Namespace) -> dict[str, Any]:
    dmtd = shutil.which("dmtd") or str(Path(sys.executable).with_name("dmtd"))
    log = Path(tempfile.mkdtemp(prefix="dmtd-ready-")) / "serve.log"
    cmd = [dmtd, "serve", "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port)]
    t_start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        while "dmtd is serving" not in log.read_text():
            if proc.poll() is not None or time.perf_counter() - t_start > args.timeout_s:
                raise RuntimeError(f"dmtd serve did not come up; its log: {log}")
            time.sleep(0.2)
        ready_s = time.perf_counter() - t_start
        url = f"http://127.0.0.1:{args.http_port}"
        model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"][0]["id"]
        ttfts = [_ttft(url, model, CHATS[i % len(CHATS)] + f" ({i})", args.max_tokens)
                 for i in range(args.requests)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    steady = statistics.median(ttfts[1:])
    result = {"ready_s": ready_s, "first_ttft_ms": 1e3 * ttfts[0], "steady_ttft_ms": 1e3 * steady,
              "first_over_steady": ttfts[0] / steady, "ttfts_ms": [1e3 * t for t in ttfts]}
    print(f"dmtd serve said it serves after {ready_s:.1f} s; first request TTFT {1e3 * ttfts[0]:.0f} ms, the next "
          f"{len(ttfts) - 1} median {1e3 * steady:.0f} ms: {result['first_over_steady']:.2f}× steady")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return result
