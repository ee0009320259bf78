"""``dmtd draft-vocab``: coverage of restricted tail vocabularies, and writing one into a variant."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dmtd.train.draft_vocab import choose, completion_counts, coverage, run_draft_vocab
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.manifest import ManifestError, read_manifest
from tests.train.helpers import TINY


def variant_over(model_dir: Path, root: Path) -> Path:
    root.mkdir(parents=True)
    layers = int(TINY["num_hidden_layers"])  # type: ignore[call-overload]
    (root / "variant.json").write_text(json.dumps({
        "name": "tiny-dmtd", "base_model": str(model_dir), "num_thinking_layers": layers - 2,
        "num_decoding_layers": 2, "tau_max": 4, "default_tau": 2}))
    return root


def args(**kw: object) -> argparse.Namespace:
    base = dict(sizes="4,16,64", size=None, json_path=None)
    return argparse.Namespace(**{**base, **kw})


def test_coverage_grows_with_size_and_the_written_vocabulary_loads(tiny_dir, tiny_corpus_dir, tmp_path):
    counts = completion_counts([tiny_corpus_dir])
    sizes = [4, 16, 64]
    covs = [coverage(counts, choose(counts, n, set())) for n in sizes]
    assert covs == sorted(covs) and 0 < covs[0] < covs[-1] <= 1.0
    ids = choose(counts, 8, {5})
    assert ids[0] == 5 and len(ids) == len(set(ids)) == 8  # EOS first, then by frequency
    root = variant_over(tiny_dir, tmp_path / "v")
    report = tmp_path / "r.json"
    assert run_draft_vocab(args(corpus=[tiny_corpus_dir], variant=root, size=16, json_path=report)) == 0
    rows = json.loads(report.read_text())["rows"]
    assert [r["size"] for r in rows][:3] == sizes and all(0 < r["tail_cost"] < 1 for r in rows)
    m = read_manifest(root)
    assert m.draft_vocab == "draft_vocab.safetensors" and m.draft_vocab_sha256
    spec = engine_spec(None, str(root))
    assert spec.draft_vocab is not None and len(spec.draft_vocab) == 16
    engine = build_engine(spec)
    assert engine.runner.draft_ids is not None and engine.runner.draft_head().shape[1] == 16


def test_bad_sizes_and_a_tampered_vocabulary_are_refused(tiny_dir, tiny_corpus_dir, tmp_path):
    root = variant_over(tiny_dir, tmp_path / "v")
    vocab = int(TINY["vocab_size"])  # type: ignore[call-overload]
    with pytest.raises(ManifestError, match=r"size: must be in 1\.\."):
        run_draft_vocab(args(corpus=[tiny_corpus_dir], variant=root, size=vocab + 1))
    assert read_manifest(root).draft_vocab is None  # nothing half-written
    run_draft_vocab(args(corpus=[tiny_corpus_dir], variant=root, size=8))
    (root / "draft_vocab.safetensors").write_bytes(b"garbage")
    with pytest.raises(ManifestError, match="draft_vocab checksum mismatch"):
        engine_spec(None, str(root))


def test_the_cli_refuses_bad_sizes_and_a_vocabulary_without_eos_before_any_work(tiny_dir, tiny_corpus_dir, tmp_path,
                                                                                capsys):
    """Exit code 2, naming the flag or field: before counting any corpus, before any request runs."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from dmtd.cli import main

    root = variant_over(tiny_dir, tmp_path / "v")
    common = ["draft-vocab", "--corpus", str(tmp_path / "no-corpus"), "--variant", str(root)]  # never read
    for bad, words in ([["--size", "0"], "--size: must be in 1..97 (the vocabulary), got 0"],
                       [["--sizes", "8,98"], "--sizes: must be in 1..97 (the vocabulary), got 98"],
                       [["--sizes", "8,lots"], "--sizes: must be comma-separated integers, got '8,lots'"]):
        assert main([*common, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
    assert read_manifest(root).draft_vocab is None

    path = root / "draft_vocab.safetensors"  # lacks the tiny model's EOS id (its config's: 2)
    save_file({"token_ids": torch.tensor([5, 6, 7], dtype=torch.int32)}, str(path))
    data = json.loads((root / "variant.json").read_text())
    data.update(draft_vocab=path.name, draft_vocab_sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (root / "variant.json").write_text(json.dumps(data))
    assert main(["generate", "--variant", str(root), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "draft_vocab lacks the EOS token id(s) [2]" in err and "Traceback" not in err
