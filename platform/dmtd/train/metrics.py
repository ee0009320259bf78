"""Losses and teacher-forced agreement metrics shared by the trainer and ``dmtd eval``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dmtd.engine.config import DMTDConfig
from dmtd.train.batches import Batch, make_batch
from dmtd.train.corpus import Record
from dmtd.train.student import DMTDStudent


@dataclass(slots=True)
class TopKTargets:
    """The teacher's distribution at N positions, stored sparsely: its top-k log-probs and the rest.

    ``ids`` [N, k] long (most likely first), ``logp`` [N, k] float, ``log_rest`` [N] float: log of the
    probability mass outside the k ids (``-inf`` when k covers the whole vocabulary).
    """

    ids: torch.Tensor
    logp: torch.Tensor
    log_rest: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.shape != self.logp.shape or self.ids.dim() != 2 or self.log_rest.shape != self.ids.shape[:1]:
            raise ValueError(f"top-k targets: ids {tuple(self.ids.shape)}, logp {tuple(self.logp.shape)} and "
                             f"log_rest {tuple(self.log_rest.shape)} must be [N, k], [N, k] and [N]")

    @property
    def top1(self) -> torch.Tensor:
        return self.ids[:, 0]


def topk_kl(logp_s: torch.Tensor, t: TopKTargets) -> torch.Tensor:
    """KL(teacher ‖ student) per position over the teacher's k ids plus one bucket for everything else.

    With k = vocabulary size this is the full KL exactly; otherwise the student's rest bucket is
    ``1 − Σ_k p_student``, computed as a log-sum-exp over the other ids (stable when the rest is tiny).
    """
    ids = t.ids.long()
    lt = t.logp.to(logp_s.dtype)
    ls = logp_s.gather(-1, ids)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    if ids.shape[1] >= logp_s.shape[1]:
        return kl
    ls_rest = torch.logsumexp(logp_s.scatter(-1, ids, float("-inf")), dim=-1)
    lr = t.log_rest.to(logp_s.dtype)
    rest = torch.where(torch.isfinite(lr), lr.exp() * (lr - ls_rest), torch.zeros_like(lr))
    return kl + rest


def distill_loss(logits_s: torch.Tensor, teacher: torch.Tensor | TopKTargets, targets: torch.Tensor,
                 is_tail: torch.Tensor, kl_weight: float, ce_weight: float, head_weight: float, tail_weight: float,
                 total_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted KL(base ‖ student) + cross-entropy over selected positions [N, V], summed / ``total_weight``.

    ``teacher`` is the base model's logits [N, V] or its cached :class:`TopKTargets`.
    """
    logp_s = F.log_softmax(logits_s.float(), dim=-1)
    w = torch.where(is_tail, tail_weight, head_weight).to(logp_s.dtype)
    loss = torch.zeros((), dtype=logp_s.dtype, device=logp_s.device)
    stats: dict[str, float] = {}
    if kl_weight:
        if isinstance(teacher, TopKTargets):
            kl = topk_kl(logp_s, teacher)
        else:
            logp_t = F.log_softmax(teacher.float(), dim=-1)
            kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
        loss = loss + kl_weight * (w * kl).sum()
        stats["kl"] = float(kl.detach().mean())
    ce = -logp_s.gather(-1, targets[:, None])[:, 0]
    if ce_weight:
        loss = loss + ce_weight * (w * ce).sum()
    stats["ce"] = float(ce.detach().mean())
    top1 = teacher.top1 if isinstance(teacher, TopKTargets) else teacher.argmax(-1)
    agree = logits_s.detach().argmax(-1) == top1
    stats["tail_agree"] = float(agree[is_tail].float().mean()) if bool(is_tail.any()) else math.nan
    stats["head_agree"] = float(agree[~is_tail].float().mean()) if bool((~is_tail).any()) else math.nan
    return loss / total_weight, stats


def distill_loss_fused(h: torch.Tensor, head: torch.Tensor, teacher: TopKTargets, targets: torch.Tensor,
                       is_tail: torch.Tensor, kl_weight: float, ce_weight: float, head_weight: float,
                       tail_weight: float, total_weight: float, compute_dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`distill_loss` for cached top-k targets from the final hidden states ``h`` [N, H] and the frozen
    head ``head`` [V, H], without materialising the logits (:mod:`dmtd.train.fused_loss`)."""
    from dmtd.train.fused_loss import head_topk_loss

    w = torch.where(is_tail, tail_weight, head_weight).float() / total_weight
    loss, kl, ce, pred = head_topk_loss(h, head, teacher.ids, teacher.logp, teacher.log_rest, targets,
                                        w * kl_weight, w * ce_weight, compute_dtype)
    stats: dict[str, float] = {"ce": float(ce.mean())}
    if kl_weight:
        stats["kl"] = float(kl.mean())
    agree = pred == teacher.top1
    stats["tail_agree"] = float(agree[is_tail].float().mean()) if bool(is_tail.any()) else math.nan
    stats["head_agree"] = float(agree[~is_tail].float().mean()) if bool((~is_tail).any()) else math.nan
    return loss, stats


def batch_weight(batch: Batch, head_weight: float, tail_weight: float) -> float:
    sel_heads = batch.head_mask[batch.loss_mask]
    return float((~sel_heads).sum()) * tail_weight + float(sel_heads.sum()) * head_weight


@torch.no_grad()
def teacher_forced(student: DMTDStudent, records: list[Record], taus: list[int], batch_size: int = 8,
                   max_len: int = 512) -> dict[int, dict[str, float]]:
    """Per τ: top-1 agreement with the base at tail and head positions, and NLL (DMTD vs base) of the
    continuation tokens, teacher-forced on ``records``."""
    dmtd: DMTDConfig = student.dmtd
    out = {}
    for tau in taus:
        n = {"tail": 0, "head": 0}
        agree = {"tail": 0, "head": 0}
        nll, base_nll, tail_nll, count = 0.0, 0.0, 0.0, 0
        for a in range(0, len(records), batch_size):
            recs = records[a: a + batch_size]
            b = make_batch(recs, [tau] * len(recs), dmtd, max_len).to(student.model.embed_tokens.weight.device)
            ls, lt = student.forward_pair(b.input_ids, b.head_mask, b.loss_mask)
            tgt = b.targets[b.loss_mask]
            is_tail = ~b.head_mask[b.loss_mask]
            same = ls.argmax(-1) == lt.argmax(-1)
            for kind, sel in (("tail", is_tail), ("head", ~is_tail)):
                n[kind] += int(sel.sum())
                agree[kind] += int(same[sel].sum())
            tok_nll = -F.log_softmax(ls.float(), -1).gather(-1, tgt[:, None])[:, 0]
            nll += float(tok_nll.sum())
            tail_nll += float(tok_nll[is_tail].sum())
            base_nll += float((-F.log_softmax(lt.float(), -1).gather(-1, tgt[:, None])[:, 0]).sum())
            count += int(tgt.numel())
        out[tau] = {
            "tail_agreement": agree["tail"] / max(n["tail"], 1),
            "head_agreement": agree["head"] / max(n["head"], 1),
            "nll": nll / max(count, 1),
            "tail_nll": tail_nll / max(n["tail"], 1),
            "base_nll": base_nll / max(count, 1),
            "num_tail": n["tail"],
            "num_head": n["head"],
        }
    return out
