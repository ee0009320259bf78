"""``dmtd bench ready``: ready means warm, as a client sees it. Starts ``dmtd serve`` as a new user does (a
subprocess, its defaults, loopback ports) and polls ``GET /v1/models`` (and ``grpc.health.v1``) as a load balancer
or a client would; the moment ``/v1/models`` first answers 200 it sends chat requests one after another through the
OpenAI endpoint (streamed, greedy): the first request's time to first token against the median of the next ones.
It also counts what the probes said before that 200 (refused connections, 503s) and whether ``/healthz`` said 200
while ``/v1/models`` still refused (it must not; gRPC health follows the same flag: dmtd.serve.readiness)."""

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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dmtd.bench.exact_bench import CHATS


def add_ready_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=6, help="chat requests after ready, one at a time")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--http-port", type=int, default=18431)
    p.add_argument("--grpc-port", type=int, default=19431)
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long /v1/models may take to answer 200")
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


def _get_status(url: str) -> int | None:
    """The HTTP status of GET ``url`` (None: no answer, e.g. the listener is not open yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def wait_first_200(url: str, proc: subprocess.Popen[bytes], t_start: float, timeout_s: float,
                   period_s: float = 0.1) -> dict[str, Any]:
    """Poll ``/v1/models`` until its first 200; before each poll, ``/healthz``. Returns the seconds to that 200 and
    what the probes answered before it."""
    seen = {"no_answer": 0, "not_ready_503": 0, "other": 0, "healthz_ok_before_models": 0}
    while True:
        healthz = _get_status(url + "/healthz")
        status = _get_status(url + "/v1/models")
        if status == 200:
            return {"ready_s": time.perf_counter() - t_start, **seen}
        if healthz == 200:  # /healthz said ready, then /v1/models (asked after it) still refused: they disagree
            seen["healthz_ok_before_models"] += 1
        seen["no_answer" if status is None else "not_ready_503" if status == 503 else "other"] += 1
        if proc.poll() is not None or time.perf_counter() - t_start > timeout_s:
            raise RuntimeError("dmtd serve did not answer /v1/models with 200")
        time.sleep(period_s)


def run_ready_bench(args: argparse.Namespace) -> dict[str, Any]:
    dmtd = shutil.which("dmtd") or str(Path(sys.executable).with_name("dmtd"))
    log = Path(tempfile.mkdtemp(prefix="dmtd-ready-")) / "serve.log"
    cmd = [dmtd, "serve", "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port)]
    t_start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{args.http_port}"
    try:
        try:
            probes = wait_first_200(url, proc, t_start, args.timeout_s)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its log: {log}") from e
        # the first chat goes at once, as a client that waited on /v1/models would send it
        model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"][0]["id"]
        ttfts = [_ttft(url, model, CHATS[i % len(CHATS)] + f" ({i})", args.max_tokens)
                 for i in range(args.requests)]
        after = {"healthz": _get_status(url + "/healthz")}
        banner_s = (time.perf_counter() - t_start) if "dmtd is serving" in log.read_text() else None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    steady = statistics.median(ttfts[1:])
    result = {**probes, "banner_seen_by_s": banner_s, "after": after, "first_ttft_ms": 1e3 * ttfts[0],
              "steady_ttft_ms": 1e3 * steady, "first_over_steady": ttfts[0] / steady,
              "ttfts_ms": [1e3 * t for t in ttfts]}
    print(f"/v1/models first answered 200 after {probes['ready_s']:.1f} s ({probes['not_ready_503']} 503s and "
          f"{probes['no_answer']} unanswered polls before); first request TTFT {1e3 * ttfts[0]:.0f} ms, the next "
          f"{len(ttfts) - 1} median {1e3 * steady:.0f} ms: {result['first_over_steady']:.2f}× steady")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return result
