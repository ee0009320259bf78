"""Confidence-adaptive cycles: a low-confidence tail token ends the cycle early."""

from __future__ import annotations

import torch

from dmtd.engine.config import DMTDConfig
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_engine, tiny_model
from tests.engine.test_refill import reference_logits


def run(min_conf: float, tau: int, anchor: str = "prompt_end"):
    model = tiny_model(seed=5)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, phase_anchor=anchor, head_input="residual_add")
    prompt = list(range(3, 15))
    res = tiny_engine(model, dmtd).generate([prompt], SamplingParams(max_new_tokens=30, cycle_len=tau,
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


def test_gate_cuts_exactly_at_low_confidence_tail_tokens():
    threshold = 0.5
    model, dmtd, prompt, res = run(threshold, 4)
    confs = res.confidences
    # Reconstruct the schedule from the rule: token i (0-based generated) sits at position P+i. A block
    # starts at a head; token j of the block (j < τ-1) below the threshold closes it.
    expected_heads, expected_blocks, block = [], [], []
    head_next = True
    for i, c in enumerate(confs):
        expected_heads.append(head_next)
        if head_next:
            since_head = 0
        block.append(res.token_ids[i])
        since_head += 1
        head_next = since_head == 4 or c < threshold
        if head_next or i == len(confs) - 1:
            expected_blocks.append(block)
            block = []
    assert res.head_flags == expected_heads
    assert res.blocks == expected_blocks
    assert 1 < len(res.blocks) < 30  # the gate did cut some cycles, not all
    # and the gated schedule is still exactly the masked forward with those heads
    ref = reference_logits(model, dmtd, prompt, res.token_ids, res.head_flags, 4)
    assert ref.argmax(-1).tolist() == res.token_ids
    probs = torch.softmax(ref, -1).max(-1).values
    torch.testing.assert_close(probs, torch.tensor(confs), rtol=1e-4, atol=1e-5)


def test_cycle_length_change_takes_effect_at_next_head():
    model = tiny_model(seed=2)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4)
    engine = tiny_engine(model, dmtd)
    rid = engine.add_request(list(range(10)), SamplingParams(max_new_tokens=20, cycle_len=4))
    heads = []
    while engine.has_unfinished():
        for o in engine.step():
            heads.append(o.is_head)
            if len(heads) == 2:
                engine.set_cycle_len(rid, 2)
    # first cycle keeps τ=4 (heads at 0, 4), then every 2
    assert heads[:8] == [True, False, False, False, True, False, True, False]
