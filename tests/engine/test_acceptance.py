"""Picking drafts and checking them (dmtd.engine.acceptance): greedy rows, rows whose logits are not finite."""

from __future__ import annotations

import math

import torch

from dmtd.engine.acceptance import check_drafts, pick_drafts
from dmtd.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, exact=True)


def test_pick_drafts_maps_to_the_vocabulary_and_marks_rows_without_a_finite_logit():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, float("nan"), 1.0], [-math.inf] * 3], dtype=torch.bfloat16)
    vocab = torch.tensor([7, 11, 13])
    d = pick_drafts(logits, vocab, [GREEDY] * 3, [None] * 3)
    assert d.finite == [True, False, False]
    assert d.tokens[0] == 11  # column 1, mapped through the draft vocabulary
    want = torch.softmax(logits[0].float(), -1).max().item()
    assert math.isclose(d.confidences[0], want, rel_tol=1e-5)
    assert d.confidences[1:] == [0.0, 0.0] and d.q == [None] * 3


def test_check_drafts_accepts_the_greedy_prefix_and_refuses_non_finite_logits():
    logits = torch.full((3, 5), -1.0)
    for pos, tok in enumerate([2, 4, 1]):  # the verifier's argmax at each position
        logits[pos, tok] = 2.0
    c = check_drafts(logits.to(torch.bfloat16), [2, 3], [None, None], None, GREEDY, None)
    assert c.finite and c.tokens == [2, 4] and c.num_accepted == 1 and len(c.confidences) == 2
    c = check_drafts(logits, [2, 4], [None, None], None, GREEDY, None)
    assert c.tokens == [2, 4, 1] and c.num_accepted == 2
    logits[1, 0] = float("nan")
    c = check_drafts(logits, [2, 4], [None, None], None, GREEDY, None)
    assert not c.finite and c.tokens == [] and c.num_accepted == 0
