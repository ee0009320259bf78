"""``dmtd data → train → eval`` end to end through the CLI, on a tiny model with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.helpers import save_tiny

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def dmtd(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dmtd", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("chat") / "m", with_tokenizer=True)


def test_data_train_eval_generate(chat_model: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Tell me about the number {i}." for i in range(8)) + "\n")
    corpus, run, variant = tmp_path / "corpus", tmp_path / "run", tmp_path / "variant"
    r = dmtd("data", "--out", str(corpus), "--model", str(chat_model), "--prompts", str(prompts), "--no-builtin",
             "--samples-per-prompt", "2", "--max-new-tokens", "16", "--held-out", "0.3", "--shard-size", "8",
             "--batch-size", "8")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((corpus / "corpus.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 2
    assert "content hash" in r.stdout

    r = dmtd("train", "--run-dir", str(run), "--corpus", str(corpus), "--base-model", str(chat_model),
             "--name", "tiny-e2e", "--num-decoding-layers", "2", "--max-steps", "4", "--batch-size", "2",
             "--checkpoint-every", "2", "--stop-after", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "latest.json").read_text())["step"] == 2
    r = dmtd("train", "--run-dir", str(run), "--export", str(variant), "--export-rank", "4",
             "--default-tau", "3", "--min-confidence", "0.5")  # resumes from the stored config
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and json.loads((run / "latest.json").read_text())["step"] == 4
    m = json.loads((variant / "variant.json").read_text())
    assert m["adapter"] == "adapter.safetensors" and m["default_tau"] == 3 and m["min_confidence"] == 0.5
    assert m["data_hash"] == manifest_hash(corpus) and m["recipe"]["steps"] == 4

    assert (variant / "heldout.jsonl").is_file() and m["heldout"] == "heldout.jsonl"
    corpus.rename(tmp_path / "moved")  # eval then runs on the held-out sample the variant carries
    report = tmp_path / "eval.json"
    r = dmtd("eval", "--variant", str(variant), "--quick", "--json", str(report), "--png", str(tmp_path / "e.png"),
             "--confidences", "0,0.5,0.7,0.9", "--record")
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    # --record put the headline into the manifest, from the same report, and the manifest still loads
    rec = json.loads((variant / "variant.json").read_text())["eval"]
    assert rec["command"].startswith("dmtd eval --variant") and "--record" not in rec["command"]
    assert rec["tau"]["3"]["tail_agreement"] == round(rep["tau"]["3"]["tail_agreement"], 3)
    assert rec["default_point"]["min_confidence"] == 0.5 and rec["default_point"]["tau"] == 3
    frontier_default = [p for p in rep["frontier"] if p["tau"] == 3 and p["min_confidence"] == 0.5][0]
    assert rec["default_point"]["speedup"] == round(frontier_default["speedup"], 3)
    assert set(rep["tau"]) == {"2", "3", "4"}
    for v in rep["tau"].values():
        assert 0 <= v["tail_agreement"] <= 1 and v["judge_ppl"] > 0 and v["tok_s"] > 0
    assert rep["corpus"]["path"].endswith("heldout.jsonl") and rep["corpus"]["content_hash"] == m["data_hash"]
    assert rep["base"]["judge_ppl"] > 0 and set(rep["floor"]["tau"]) == {"2", "3", "4"}
    assert [p["min_confidence"] for p in rep["frontier"]] == [0.0, 0.5, 0.7, 0.9]
    assert (tmp_path / "e.png").stat().st_size > 10_000

    r = dmtd("generate", "--variant", str(variant), "--chat", "Hello", "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["tau"] == 3


def manifest_hash(corpus: Path) -> str:
    from dmtd.train.corpus import read_manifest

    return read_manifest(corpus).content_hash
