"""Batch invariance on every kernel path this CPU has: a request's tokens, and the bits of the logits that chose
them, are the same alone and inside batches of companions (tests/engine/invariance_run.py, one process a path,
forced by ``DMTD_KERNEL_PATH``). A path the CPU lacks is skipped, naming the instructions; ``avx2`` and
``portable`` run on every x86-64 CPU we serve on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmtd.engine.ops import KERNEL_PATHS, cpu_paths

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_request_alone_and_among_companions_gets_the_same_tokens_and_logits_bits(path):
    if path not in cpu_paths():
        pytest.skip(f"this CPU has no {path} instructions (its paths: {', '.join(cpu_paths())})")
    env = {**os.environ, "DMTD_KERNEL_PATH": path}
    out = subprocess.run([sys.executable, "-m", "tests.engine.invariance_run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["path"] == path  # the path asked for is the one that ran
    # two of them on a Qwen-shaped model (qkv bias, per-head q/k norms), two with a bfloat16 KV cache (not on amx)
    assert result["cases"] == (14 if path == "amx" else 16)
    assert result["diffs"] == []
    # answers reused on this path: a second turn reads its first turn's published answer and still gets the base
    # model's tokens (AMX publishes none: its prefill and decode products round differently)
    turns = result["second_turns"]
    assert turns["diffs"] == []
    assert turns["publishes"] == (path != "amx")
    assert (turns["cached_tokens"] > 0) == turns["publishes"]
    turns16 = result["second_turns_kv16"]  # and with a bfloat16 KV cache
    assert (turns16 is None) == (path == "amx")
    if turns16 is not None:
        assert turns16["diffs"] == [] and turns16["cached_tokens"] > 0
