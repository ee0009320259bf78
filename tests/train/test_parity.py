"""Train/serve parity: after training, the trainer's masked forward equals the engine's incremental logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.train.export import export_variant
from dmtd.train.routing import head_flags
from dmtd.train.trainer import Trainer
from dmtd.variants.build import build_engine, engine_spec
from tests.train.helpers import tiny_prompts, train_config

CASES = [
    dict(scope="decoding"),
    dict(scope="all", head_input="residual_add"),
    dict(scope="lora", lora_rank=4, lora_layers="2-5"),
    dict(scope="decoding", num_encoding_layers=1, phase_anchor="absolute", head_input="residual_add"),
]


def engine_logits(engine, prompt: list[int], tau: int, n: int) -> tuple[list[int], list[bool], torch.Tensor]:
    """Greedy-generate ``n`` tokens at cycle length ``tau``, capturing the logits of every step."""
    got: list[torch.Tensor] = []
    orig = engine.runner.state.logits

    def capture(h: torch.Tensor) -> torch.Tensor:
        out = orig(h)
        got.append(out[0].clone())
        return out

    engine.runner.state.logits = capture
    try:
        res = engine.generate([prompt], SamplingParams(max_new_tokens=n, tau=tau, ignore_eos=True))[0]
    finally:
        del engine.runner.state.logits
    return res.token_ids, res.head_flags, torch.stack(got)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_trained_masked_forward_equals_engine(case, tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, max_steps=4, **case)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    trainer.run()
    assert any(not torch.equal(before[n], p) for n, p in trainer.params.items()), "training changed nothing"
    out = tmp_path / "variant"
    export_variant(trainer.student, cfg, out, trainer.fingerprint, trainer.corpus.content_hash)
    engine = build_engine(engine_spec(str(tiny_dir), str(out)), EngineConfig(max_num_seqs=2, max_model_len=128))
    d = trainer.dmtd
    for tau, prompt in zip((2, 3, 4), tiny_prompts(3, seed=5)):
        tokens, heads, got = engine_logits(engine, prompt, tau, 13)
        ids = prompt + tokens[:-1]
        flags = head_flags(d, len(prompt), len(ids), tau)
        assert flags[len(prompt) - 1:] == heads  # the trainer routes exactly as the engine did
        ref = trainer.student.masked_logits(torch.tensor([ids]), torch.tensor([flags]))[0, len(prompt) - 1:]
        assert ref.argmax(-1).tolist() == tokens
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_untrained_student_is_the_engine_forward_masked(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    """Before any step the student's masked forward is the engine model's ``forward_masked`` bit for bit."""
    cfg = train_config(tiny_dir, tiny_corpus_dir, scope="lora", lora_rank=2)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    ids = torch.tensor([tiny_prompts(1, seed=9)[0] * 3])
    mask = torch.tensor([head_flags(trainer.dmtd, 4, ids.shape[1], 3)])
    with torch.no_grad():
        ref = trainer.loaded.model.forward_masked(ids, mask, trainer.dmtd)
    assert torch.equal(trainer.student.masked_logits(ids, mask), ref)


def test_phase_aligned_batches_match_the_jittered_training_routing(tiny_dir: Path, tiny_corpus_dir: Path,
                                                                   tmp_path: Path):
    """Batched serving shortens a row's first cycle to a shared clock; training's ``first_cycle`` covers it."""
    cfg = train_config(tiny_dir, tiny_corpus_dir, max_steps=3, phase_jitter=True)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.run()
    export_variant(trainer.student, cfg, tmp_path / "v", trainer.fingerprint, trainer.corpus.content_hash)
    engine = build_engine(engine_spec(str(tiny_dir), str(tmp_path / "v")), EngineConfig(max_num_seqs=2))
    prompts = tiny_prompts(3, seed=2)
    params = [SamplingParams(max_new_tokens=n, tau=3, ignore_eos=True) for n in (5, 16, 16)]
    results = engine.generate(prompts, params)  # the third row joins mid-flight, off the shared clock
    firsts = []
    for p, res in zip(prompts, results):
        first = next(i for i, h in enumerate(res.head_flags[1:], 1) if h)
        firsts.append(first)
        flags = head_flags(trainer.dmtd, len(p), len(p) + len(res.token_ids) - 1, 3, first)
        assert flags[len(p) - 1:] == res.head_flags
        ids = torch.tensor([p + res.token_ids[:-1]])
        ref = trainer.student.masked_logits(ids, torch.tensor([flags]))[0, len(p) - 1:]
        assert ref.argmax(-1).tolist() == res.token_ids
    assert firsts[2] < 3  # the late row's first cycle was shortened
