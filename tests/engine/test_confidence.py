"""Confidence-adaptive cycles: a low-confidence tail token is dropped and its position redone at a head."""

from __future__ import annotations

import torch

from dmtd.engine.config import DMTDConfig
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_engine, tiny_model
from tests.engine.test_refill import reference_logits


def run(min_conf: float, tau: int, anchor: str = "prompt_end", seed: int = 5):
    model = tiny_model(seed=seed)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, phase_anchor=anchor, head_input="residual_add")
    prompt = list(range(3, 15))
    res = tiny_engine(model, dmtd).generate([prompt], SamplingParams(max_new_tokens=30, tau=tau,
                                                                     min_confidence=min_conf))[0]
    return model, dmtd, prompt, res


def test_min_confidence_one_makes_every_position_a_head():
    _, _, _, gated = run(1.0, 4)
    _, _, _, ar = run(0.0, 1)
    assert all(gated.head_flags)
    assert gated.token_ids == ar.token_ids
    assert [len(b) for b in gated.blocks] == [1] * 30


def test_min_confidence_zero_gives_fixed_cycles():
    for tau in (2, 3, 4):
        _, _, _, res = run(0.0, tau)
        lens = [len(b) for b in res.blocks]
        assert lens[:-1] == [tau] * (len(lens) - 1)
        assert sum(lens) == 30
        assert res.head_flags == [(i % tau) == 0 for i in range(30)]


def test_gate_drops_low_confidence_tail_tokens_and_redoes_them_at_heads():
    threshold, tau = 0.7, 4  # seed 2's tail confidences spread over 0.4..1.0
    model, dmtd, prompt, res = run(threshold, tau, seed=2)
    confs, heads = res.confidences, res.head_flags
    # every emitted token is a head's or a confident tail's, and no tail follows an uncertain token
    assert all(h or c >= threshold for h, c in zip(heads, confs))
    assert all(heads[i + 1] for i in range(len(confs) - 1) if confs[i] < threshold)
    # blocks start at heads and hold at most τ tokens
    starts = [i for i, h in enumerate(heads) if h]
    assert starts[0] == 0
    assert [len(b) for b in res.blocks] == [b - a for a, b in zip(starts, starts[1:] + [len(heads)])]
    assert max(len(b) for b in res.blocks) <= tau and sum(map(len, res.blocks)) == 30
    cut = [i for a, i in zip(starts, starts[1:]) if i - a < tau]  # blocks closed early by the gate
    assert cut and any(len(b) > 1 for b in res.blocks)  # the gate cut some cycles, not all
    # the realised schedule is exactly the masked forward with those heads (tokens and confidences)
    ref = reference_logits(model, dmtd, prompt, res.token_ids, heads, tau)
    assert ref.argmax(-1).tolist() == res.token_ids
    probs = torch.softmax(ref, -1).max(-1).values
    torch.testing.assert_close(probs, torch.tensor(confs), rtol=1e-4, atol=1e-5)
    # and each early head follows an uncertain head token (no tail is tried after it) or replaced a tail
    # prediction that fell below the threshold (dropped and redone)
    kinds = set()
    for i in cut:
        if confs[i - 1] < threshold:
            assert heads[i - 1]  # only a head's token can be uncertain and still be emitted
            kinds.add("skip")
            continue
        as_tail = list(heads)
        as_tail[i] = False
        p_tail = torch.softmax(reference_logits(model, dmtd, prompt, res.token_ids, as_tail, tau)[i], -1).max()
        assert float(p_tail) < threshold
        kinds.add("redo")
    assert "redo" in kinds


def test_cycle_length_change_takes_effect_at_next_head():
    model = tiny_model(seed=2)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4)
    engine = tiny_engine(model, dmtd)
    rid = engine.add_request(list(range(10)), SamplingParams(max_new_tokens=20, tau=4))
    heads = []
    while engine.has_unfinished():
        for o in engine.step():
            heads.append(o.is_head)
            if len(heads) == 2:
                engine.retune(rid, tau=2)
    # first cycle keeps τ=4 (heads at 0, 4), then every 2
    assert heads[:8] == [True, False, False, False, True, False, True, False]
