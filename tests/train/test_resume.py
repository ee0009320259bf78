"""Exact resume: interrupt, restart, and end at bitwise the same weights as an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dmtd.train.checkpoint import CheckpointError
from dmtd.train.trainer import Trainer, lr_at
from tests.train.helpers import train_config


@pytest.mark.parametrize("scope", ["decoding", "lora"])
def test_interrupted_run_ends_at_identical_weights(scope: str, tiny_dir: Path, tiny_corpus_dir: Path,
                                                   tmp_path: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, scope=scope, lora_rank=4, max_steps=7, checkpoint_every=2)
    whole = Trainer(cfg, tmp_path / "whole", progress=False)
    whole.run()

    first = Trainer(cfg, tmp_path / "split", progress=False)
    step = first.train_step

    def dies_in_step_6(s: int) -> dict[str, float]:
        if s == 5:
            raise RuntimeError("killed")
        return step(s)

    first.train_step = dies_in_step_6  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed"):
        first.run()
    del first
    second = Trainer(cfg, tmp_path / "split", progress=False)
    assert second.state.step == 4  # the last checkpoint; step 5 is redone
    second.run()
    assert second.state.step == whole.state.step == 7
    for name, p in whole.params.items():
        assert torch.equal(p, second.params[name]), name
    # the same data order: the logged per-step losses agree; the resumed run dropped the killed run's line
    # for step 5 (past its checkpoint) and logged it again, so the log reads like an uninterrupted one
    a = [json.loads(x) for x in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in b] == list(range(1, 8))
    assert [x["loss"] for x in a] == [x["loss"] for x in b]
    assert second.state.tokens_seen == whole.state.tokens_seen


def test_resume_refuses_a_changed_recipe(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, max_steps=2)
    Trainer(cfg, tmp_path / "run", progress=False).run()
    with pytest.raises(CheckpointError, match="different config.*lr"):
        Trainer(train_config(tiny_dir, tiny_corpus_dir, max_steps=2, lr=1e-2), tmp_path / "run", progress=False)
    # a longer schedule is allowed (the resumable fields)
    t = Trainer(train_config(tiny_dir, tiny_corpus_dir, max_steps=3), tmp_path / "run", progress=False)
    assert t.state.step == 2


def test_schedule_warms_up_then_decays_to_the_floor(tiny_dir: Path, tiny_corpus_dir: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, lr=1e-3, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(21)]
    assert lrs[0] == pytest.approx(2.5e-4) and lrs[3] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[20] == pytest.approx(1e-4)


def test_init_from_starts_a_new_run_from_trained_weights(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    first = Trainer(train_config(tiny_dir, tiny_corpus_dir, max_steps=2), tmp_path / "a", progress=False)
    first.run()
    cont = Trainer(train_config(tiny_dir, tiny_corpus_dir, max_steps=2, init_from=str(tmp_path / "a" /
                                                                                     "ckpt-000002.pt")),
                   tmp_path / "b", progress=False)
    assert cont.state.step == 0
    assert all(torch.equal(p, first.params[n]) for n, p in cont.params.items())
    with pytest.raises(CheckpointError, match="lacks"):
        Trainer(train_config(tiny_dir, tiny_corpus_dir, num_decoding_layers=3,
                             init_from=str(tmp_path / "a" / "ckpt-000002.pt")), tmp_path / "c", progress=False)


def test_init_from_an_exported_variant_directory(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    """A run on a new machine goes on from the variant in the repository: its tensors, adapter merged."""
    from dmtd.train.export import export_variant

    first = Trainer(train_config(tiny_dir, tiny_corpus_dir, max_steps=2), tmp_path / "a", progress=False)
    first.run()
    out = tmp_path / "variant"
    export_variant(first.student, first.cfg, out, first.fingerprint, first.corpus.content_hash)
    cont = Trainer(train_config(tiny_dir, tiny_corpus_dir, max_steps=2, init_from=str(out)), tmp_path / "b",
                   progress=False)
    assert cont.state.step == 0
    for n, p in cont.params.items():
        torch.testing.assert_close(p, first.params[n], rtol=0, atol=1e-6)
    with pytest.raises(CheckpointError, match="D=2; this run has E=0, D=3"):
        Trainer(train_config(tiny_dir, tiny_corpus_dir, num_decoding_layers=3, init_from=str(out)), tmp_path / "c",
                progress=False)
    (out / "variant.json").write_text("{}")
    with pytest.raises(CheckpointError, match="--init-from"):
        Trainer(train_config(tiny_dir, tiny_corpus_dir, init_from=str(out)), tmp_path / "d", progress=False)
