"""``dmtd eval``'s exact-profile section on tiny variants: the tokens are the verifier's, the acceptance and
speed figures come from the same runs, and --record carries them into the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmtd.cli import main
from dmtd.train.corpus import load_corpus
from dmtd.train.evaluate import EvalConfig, Evaluator, headline
from dmtd.train.export import export_variant
from dmtd.train.trainer import Trainer
from dmtd.variants.loader import load_model
from dmtd.variants.manifest import read_manifest
from tests.train.helpers import train_config


def trained(tiny_dir: Path, corpus: Path, root: Path, **kw: object) -> Path:
    cfg = train_config(tiny_dir, corpus, max_steps=2, **kw)
    t = Trainer(cfg, root / "run", progress=False)
    t.run()
    export_variant(t.student, cfg, root / "v", t.fingerprint, t.corpus.content_hash, default_tau=3,
                   min_confidence=0.2, heldout=t.heldout)
    return root / "v"


@pytest.fixture(scope="module")
def variants(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"base": trained(tiny_dir, tiny_corpus_dir, tmp_path_factory.mktemp("dec"), scope="lora", lora_rank=2),
            "variant": trained(tiny_dir, tiny_corpus_dir, tmp_path_factory.mktemp("all"), scope="all")}


def evaluate(root: Path, corpus: Path, **cfg: object) -> dict:
    manifest = read_manifest(root)
    base_name = manifest.base_model
    ev = Evaluator(load_model(base_name), manifest, root, load_model(base_name),
                   EvalConfig(taus=[2], num_tf_records=4, num_prompts=4, max_new_tokens=16, confidences=[0.0],
                              frontier_taus=[2], speed_prompts=1, speed_tokens=12, batch_size=4, **cfg))  # type: ignore[arg-type]
    return ev.run(load_corpus(corpus).split("heldout"), progress=False)


@pytest.mark.parametrize("verifier", ["base", "variant"])
def test_exact_rows_equal_the_verifiers_tokens_and_report_acceptance(variants, tiny_corpus_dir, verifier):
    report = evaluate(variants[verifier], tiny_corpus_dir, exact_taus=[2, 4], draft_threshold=0.0)
    ex = report["exact"]
    assert ex["verifier"] == verifier and ex["draft_threshold"] == 0.0 and ex["base_tau1_tok_s"] > 0
    assert set(ex["tau"]) == {"2", "4"}
    for tau, row in ex["tau"].items():
        assert row["tokens_match"] == 1.0  # greedy: every prompt's tokens are the verifier's own τ = 1 tokens
        assert row["drafted"] > 0 and 0 <= row["accepted"] <= row["drafted"]
        assert row["acceptance"] == pytest.approx(row["accepted"] / row["drafted"])
        assert len(row["acceptance_by_pos"]) == int(tau) - 1
        assert all(a is None or 0 <= a <= 1 for a in row["acceptance_by_pos"])
        assert 0 <= row["accepted_per_cycle"] <= int(tau) - 1 and 1 <= row["tokens_per_cycle"] <= int(tau)
        assert row["tok_s"] > 0 and row["speedup_vs_base_tau1"] == pytest.approx(row["tok_s"] / ex["base_tau1_tok_s"])
    head = headline(report, 3, 0.2, "dmtd eval …")["exact"]
    assert head["verifier"] == verifier and head["tau"]["4"]["tokens_match"] == 1.0
    assert head["tau"]["2"]["speedup_vs_base_tau1"] == round(ex["tau"]["2"]["speedup_vs_base_tau1"], 3)


def test_eval_cli_records_the_exact_profile_and_refuses_bad_input(variants, tiny_corpus_dir, tmp_path, capsys):
    root = variants["base"]
    common = ["eval", "--variant", str(root), "--corpus", str(tiny_corpus_dir), "--quick", "--taus", "2",
              "--frontier-taus", "2", "--confidences", "0", "--num-prompts", "3", "--max-new-tokens", "12"]
    for bad, words in ([["--draft-threshold", "1.5"], "--draft-threshold: must be in [0, 1], got 1.5"],
                       [["--exact-taus", "1"], "--exact-taus: must lie in 2..4"],
                       [["--exact-taus", "5"], "--exact-taus: must lie in 2..4"]):
        assert main([*common, *bad]) == 2
        assert words in capsys.readouterr().err
    report = tmp_path / "eval.json"
    assert main([*common, "--exact-taus", "3", "--json", str(report), "--record"]) == 0
    printed = capsys.readouterr().out
    assert "exact profile (verifier base, draft threshold 0.2" in printed
    rep = json.loads(report.read_text())["exact"]
    rec = json.loads((root / "variant.json").read_text())["eval"]["exact"]
    # the variant's min_confidence (0.2) is the default draft stop: a tiny random model is rarely that sure,
    # so it may draft nothing (acceptance None), and its tokens are the base's all the same
    acceptance = rep["tau"]["3"]["acceptance"]
    assert rec["tau"]["3"]["acceptance"] == (None if acceptance is None else round(acceptance, 3))
    assert rec["tau"]["3"]["tokens_match"] == 1.0 and rec["draft_threshold"] == 0.2
    assert read_manifest(root).eval is not None  # still a valid manifest


def test_eval_runs_its_engines_in_the_asked_precision(variants, tiny_corpus_dir):
    """int8 engines: the exact profile still gives the (int8) verifier's own tokens; the report says so."""
    report = evaluate(variants["base"], tiny_corpus_dir, exact_taus=[2], draft_threshold=0.0, quant="int8")
    assert report["exact"]["tau"]["2"]["tokens_match"] == 1.0
    assert report["exact"]["tau"]["2"]["drafted"] > 0
