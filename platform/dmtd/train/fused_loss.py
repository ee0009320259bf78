"""The head and the cached-teacher loss in one pass over row chunks, never holding [N, V] logits.

A cached training step (teacher top-k from ``dmtd cache``) spent over half its time on vocabulary-wide
elementwise work — the float32 copy of the logits, log-softmax forward and backward, the rest bucket's
masked log-sum-exp and its backward, argmax — each a pass over an [N, 49152] tensor of ~240 MB (torch's
profiler, one step of the shipped recipe). The lm_head is frozen (tied embeddings), so only the gradient
with respect to the hidden states is needed, and it has a closed form: with the student's softmax ``p``, the
teacher's top-k probabilities ``pt`` on ids K, its rest mass ``rt`` and ``S = Σ pt + rt``,

    dKL/dz_j = p_j·S − pt_j                                  (j in K)
    dKL/dz_j = p_j·S − rt·p_j / r_s                           (j not in K; r_s the student's rest mass)
    dCE/dz_j = p_j − [j = target]

So the forward computes, chunk by chunk, the logits (AMX matmul in bf16 when asked), the loss terms, the
argmax and that gradient, multiplies it back through the head (``g @ W``) and keeps only ``dL/dh`` [N, H]
for the backward. The same loss as :func:`dmtd.train.metrics.distill_loss` with :class:`TopKTargets`
(tested to 1e-5, value and gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _HeadTopKLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logp_t: torch.Tensor,
                log_rest: torch.Tensor, target: torch.Tensor, w_kl: torch.Tensor, w_ce: torch.Tensor,
                compute_dtype: torch.dtype, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
        n = h.shape[0]
        w = weight.to(compute_dtype)
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        kl_all = torch.empty(n, dtype=torch.float32, device=h.device)
        ce_all = torch.empty_like(kl_all)
        pred = torch.empty(n, dtype=torch.long, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                z = F.linear(h[a:b].to(compute_dtype), w).float()  # [c, V]
                pred[a:b] = z.argmax(-1)
                lse = torch.logsumexp(z, -1)
                k_ids, tgt = ids[a:b], target[a:b]
                z_k, z_t = z.gather(1, k_ids), z.gather(1, tgt[:, None])[:, 0]
                lpt = logp_t[a:b].float()
                pt = lpt.exp()
                kl = (pt * (lpt - (z_k - lse[:, None]))).sum(-1)
                ce_all[a:b] = lse - z_t
                p = torch.exp(z.sub_(lse[:, None]))  # the student's softmax (z's storage is free now)
                p_k = p.gather(1, k_ids)
                p.scatter_(1, k_ids, 0.0)  # p off K: the rest bucket, summed without cancellation
                rest_s = p.sum(-1)
                lr = log_rest[a:b].float()
                finite = torch.isfinite(lr) & (rest_s > 0)
                rt = torch.where(finite, lr.exp(), torch.zeros_like(lr))
                ls_rest = torch.log(rest_s.clamp_min(torch.finfo(torch.float32).tiny))
                kl = kl + torch.where(finite, rt * (lr - ls_rest), torch.zeros_like(lr))
                kl_all[a:b] = kl
                s = pt.sum(-1) + rt
                ratio = torch.where(finite, rt / rest_s.clamp_min(torch.finfo(torch.float32).tiny),
                                    torch.zeros_like(rt))
                wk, wc = w_kl[a:b], w_ce[a:b]
                g = p.mul_((wk * (s - ratio) + wc)[:, None])  # off K
                g.scatter_(1, k_ids, wk[:, None] * (p_k * s[:, None] - pt) + wc[:, None] * p_k)
                g.scatter_add_(1, tgt[:, None], -wc[:, None])
                grad_h[a:b] = (g.to(compute_dtype) @ w).to(h.dtype)
        loss = (w_kl * kl_all).sum() + (w_ce * ce_all).sum()
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(kl_all, ce_all, pred)
        return loss, kl_all, ce_all, pred

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype),) + (None,) * 9


def head_topk_loss(h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logp_t: torch.Tensor,
                   log_rest: torch.Tensor, target: torch.Tensor, w_kl: torch.Tensor, w_ce: torch.Tensor,
                   compute_dtype: torch.dtype = torch.float32, chunk: int = 64
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_rows w_kl·KL(teacher top-k + rest ‖ softmax(h Wᵀ)) + w_ce·CE(target), differentiable in ``h`` [N, H]
    (``weight`` [V, H] is frozen); also each row's KL, CE and argmax token."""
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = _HeadTopKLoss.apply(
        h, weight.detach(), ids.long(), logp_t, log_rest, target.long(), w_kl.float(), w_ce.float(),
        compute_dtype, chunk)
    return out
