"""The fused head + cached-teacher loss equals the plain one (logits, log-softmax, top-k KL + rest, CE)."""

from __future__ import annotations

import math

import pytest
import torch

from dmtd.train.cache import teacher_targets
from dmtd.train.metrics import TopKTargets, distill_loss, distill_loss_fused


@pytest.mark.parametrize("k", [5, 50])  # 50 = the whole vocabulary: no rest bucket
@pytest.mark.parametrize("kl_weight,ce_weight", [(1.0, 0.0), (0.0, 1.0), (0.7, 0.3)])
def test_fused_loss_value_gradient_and_stats_equal_the_plain_ones(k, kl_weight, ce_weight):
    torch.manual_seed(k)
    n, hidden, vocab = 37, 16, 50
    weight = torch.randn(vocab, hidden)
    teacher = TopKTargets(*teacher_targets(torch.randn(n, vocab) * 3, k))
    targets = torch.randint(0, vocab, (n,))
    is_tail = torch.rand(n) < 0.6
    h0 = torch.randn(n, hidden)
    args = (teacher, targets, is_tail, kl_weight, ce_weight, 1.0, 0.5, 11.0)

    h1 = h0.clone().requires_grad_(True)
    loss1, stats1 = distill_loss(h1 @ weight.t(), *args)
    loss1.backward()
    h2 = h0.clone().requires_grad_(True)
    loss2, stats2 = distill_loss_fused(h2, weight, *args)
    loss2.backward()

    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)
    assert stats2.keys() == stats1.keys()
    for key, v in stats1.items():
        assert (math.isnan(v) and math.isnan(stats2[key])) or stats2[key] == pytest.approx(v, rel=1e-5, abs=1e-6)


def test_chunks_do_not_change_the_result_and_bf16_stays_close():
    from dmtd.train.fused_loss import head_topk_loss

    torch.manual_seed(3)
    n, hidden, vocab = 70, 32, 97
    weight = torch.randn(vocab, hidden) / 4
    ids, logp, rest = teacher_targets(torch.randn(n, vocab) * 2, 8)
    targets = torch.randint(0, vocab, (n,))
    w = torch.rand(n)
    h = torch.randn(n, hidden)
    outs = []
    for chunk, dtype in ((7, torch.float32), (64, torch.float32), (16, torch.bfloat16)):
        x = h.clone().requires_grad_(True)
        loss, kl, ce, pred = head_topk_loss(x, weight, ids, logp, rest, targets, w, w * 0.5, dtype, chunk)
        loss.backward()
        outs.append((loss.detach(), x.grad, kl, pred))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][3], outs[1][3])
    torch.testing.assert_close(outs[2][0], outs[0][0], rtol=3e-2, atol=0)
    cos = torch.nn.functional.cosine_similarity(outs[2][1].flatten(), outs[0][1].flatten(), dim=0)
    assert cos > 0.99
