"""`dmtd generate --server` and client-requested re-chunking, over the real stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dmtd.client import DMTDClient


def test_generate_server_json_line_matches_the_stream(stack, smollm2):
    r = subprocess.run([sys.executable, "-m", "dmtd", "generate", "--server", stack.grpc_target, "--prompt",
                        "Once upon a time", "--max-new-tokens", "12", "--tau", "3", "--min-confidence", "0",
                        "--json"], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"prompt_token_ids", "token_ids", "text", "tokens_per_s", "mean_block_len"} <= out.keys()
    assert len(out["token_ids"]) == sum(out["block_lens"]) and out["tau"] == 3
    # the server reports the prompt's length, not its ids: the length the model's tokenizer gives
    n_prompt = len(smollm2.tokenizer.encode("Once upon a time", add_special_tokens=False))
    assert out["prompt_token_ids"] is None and out["prompt_tokens"] == n_prompt
    assert out["finish_reason"] in ("length", "stop") and out["text"]
    bad = subprocess.run([sys.executable, "-m", "dmtd", "generate", "--server", stack.grpc_target, "--prompt", "x",
                          "--variant", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "NOT_FOUND" in bad.stderr


def test_min_block_tokens_rechunks_the_stream(stack):
    with DMTDClient(stack.grpc_target) as c:
        plain = list(c.generate(prompt="The rain in Spain", max_new_tokens=20, tau_min=1, tau_max=1,
                                min_confidence=0.0, ignore_eos=True))
        chunked = list(c.generate(prompt="The rain in Spain", max_new_tokens=20, tau_min=1, tau_max=1,
                                  min_confidence=0.0, ignore_eos=True, min_block_tokens=5))
    assert [t for b in chunked for t in b.token_ids] == [t for b in plain for t in b.token_ids]
    # plain: a message per stream interval (the stack's default, 40 ms), each one or more cycles of τ = 1
    assert sum(b.k for b in plain) == 20 and all(b.k >= 1 for b in plain)
    assert all(len(b.token_ids) >= 5 for b in chunked[:-1]) and len(chunked) <= 4
    assert "".join(b.text for b in chunked) == "".join(b.text for b in plain)
    assert chunked[-1].finish_reason and chunked[-1].usage.completion_tokens == 20
