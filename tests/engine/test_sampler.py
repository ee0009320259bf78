"""The batched sampler: the per-row distributions of the textbook recipe, draws that follow them."""

from __future__ import annotations

import torch

from dmtd.engine.sampler import draw, filtered_probs, sample
from dmtd.engine.sequence import SamplingParams


def one_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: temperature, top-k, top-p for one row, with a full sort."""
    row = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        s, idx = torch.sort(row, descending=True)
        pr = torch.softmax(s, -1)
        row = row.scatter(0, idx, s.masked_fill(pr.cumsum(-1) - pr >= p.top_p, float("-inf")))
    return torch.softmax(row, -1)


PARAMS = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=0.9, top_p=0.6, seed=3),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=4),
    SamplingParams(temperature=2.0, top_k=1, seed=5),
    SamplingParams(temperature=3.0, top_p=0.999, seed=6),  # a nucleus wider than the topk probe
]


def test_batched_distributions_equal_per_row_recipe():
    logits = torch.randn(len(PARAMS), 3000, generator=torch.Generator().manual_seed(0)) * 3
    got = filtered_probs(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        ref = one_row(logits[i], p)
        torch.testing.assert_close(got[i], ref, rtol=1e-5, atol=1e-7)
        assert torch.equal(got[i] > 0, ref > 0), p  # same support exactly
    assert int((got[5] > 0).sum()) > 1024  # the last row took the full-sort fallback


def test_draws_follow_the_distribution_and_the_seed():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    g = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    counts = torch.zeros(5)
    for _ in range(4000):
        a, b = draw(probs, g)
        counts[a] += 1
        assert b == 3
    freq = counts / counts.sum()
    assert freq[1] == 0 and freq[4] == 0  # zero-probability tokens are never drawn
    torch.testing.assert_close(freq, probs[0], atol=0.03, rtol=0)
    again = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    first = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    assert [draw(probs, again) for _ in range(20)] == [draw(probs, first) for _ in range(20)]


def test_sample_mixes_greedy_sampled_and_non_finite_rows():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 2
    logits[2] = float("nan")
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3, seed=0), SamplingParams(temperature=1.0)]
    gens = [None, torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)]
    seen = set()
    for _ in range(200):
        toks, conf, finite = sample(logits, params, gens)
        assert toks[0] == int(logits[0].argmax())
        seen.add(toks[1])
        assert finite == [True, True, False] and conf[2] == 0.0
    assert seen <= set(logits[1].topk(3).indices.tolist()) and len(seen) > 1
    torch.testing.assert_close(torch.tensor(conf[:2]), torch.softmax(logits[:2], -1).amax(-1))
