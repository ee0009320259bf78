"""``dmtd serve`` as a new user starts it — no precision flag, the shipped variant and its default (exact) profile —
serves bfloat16 where the kernels build, and four concurrent greedy chat requests through the OpenAI endpoint get
the base model's own text: the base model (``--variant none``) run alone on each prompt in bfloat16."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHATS = ["Name three colours.", "Why do cats purr? Answer in a short paragraph.",
         "Give me a simple recipe for pancakes.", "What is the capital of France?"]
MAX_TOKENS = 32

# runs inside the server's network namespace: waits for /v1/models, then the four requests at once
CLIENT = r'''
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, chats, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
deadline = time.time() + 300
while True:
    try:
        models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=5))
        break
    except Exception:
        if time.time() > deadline:
            raise
        time.sleep(1)
model = models["data"][0]["id"]
def ask(chat):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": chat}], "temperature": 0,
                       "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
with ThreadPoolExecutor(len(chats)) as pool:
    answers = list(pool.map(ask, chats))
print(json.dumps({"models": models, "answers": answers}))
'''


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for unshare -n")
def test_dmtd_serve_defaults_to_bf16_exact_and_four_concurrent_requests_get_the_base_models_text(tmp_path):
    from dmtd.engine.config import EngineConfig
    from dmtd.engine.lowbit import resolve_dtype
    from dmtd.engine.sequence import SamplingParams
    from dmtd.variants.build import build_engine, engine_spec

    assert resolve_dtype("auto", "cpu") == "bfloat16"  # every CPU kind we run on builds the vector kernels
    (tmp_path / "client.py").write_text(CLIENT)
    dmtd, py = str(Path(sys.executable).with_name("dmtd")), sys.executable
    script = (f"ip link set lo up; {dmtd} serve --http-port 18123 --grpc-port 19123 > {tmp_path}/serve.log 2>&1 & "
              f"pid=$!; for i in $(seq 600); do grep -q 'dmtd is serving' {tmp_path}/serve.log && break; "
              "kill -0 $pid 2>/dev/null || break; sleep 1; done; "  # the banner, printed once the stack is up
              f"{py} {tmp_path}/client.py http://127.0.0.1:18123 '{json.dumps(CHATS)}' {MAX_TOKENS}; rc=$?; "
              "kill -TERM $pid; for i in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done; "
              "kill -KILL $pid 2>/dev/null; exit $rc")
    done = subprocess.run(["unshare", "-n", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    log = (tmp_path / "serve.log").read_text() if (tmp_path / "serve.log").exists() else ""
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert "precision bfloat16 " in log
    # every shipped variant of the trunk, served by each replica from a fresh start (registered by dmtd serve)
    assert {m["id"] for m in served["models"]["data"]} >= {"smollm2-135m-dmtd", "smollm2-135m-dmtd-lite"}
    base = build_engine(engine_spec(None, "none", dtype=__import__("torch").bfloat16),
                        EngineConfig(max_num_seqs=1, max_model_len=1024, dtype="bfloat16"))
    for chat, answer in zip(CHATS, served["answers"]):
        ref = base.generate([[{"role": "user", "content": chat}]], SamplingParams(max_new_tokens=MAX_TOKENS))[0]
        assert answer["choices"][0]["message"]["content"] == ref.text, chat
        assert answer["usage"]["completion_tokens"] == len(ref.token_ids)
