"""Losses and teacher-forced agreement metrics shared by the trainer and ``dmtd eval``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dmtd.engine.config import DMTDConfig
from dmtd.train.batches import Batch, make_batch
from dmtd.train.corpus import Record
from dmtd.train.student import DMTDStudent


def distill_loss(logits_s: torch.Tensor, logits_t: torch.Tensor, targets: torch.Tensor, is_tail: torch.Tensor,
                 kl_weight: float, ce_weight: float, head_weight: float, tail_weight: float,
                 total_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted KL(base ‖ student) + cross-entropy over selected positions [N, V], summed / ``total_weight``."""
    logp_s = F.log_softmax(logits_s.float(), dim=-1)
    w = torch.where(is_tail, tail_weight, head_weight).to(logp_s.dtype)
    loss = torch.zeros((), dtype=logp_s.dtype, device=logp_s.device)
    stats: dict[str, float] = {}
    if kl_weight:
        logp_t = F.log_softmax(logits_t.float(), dim=-1)
        kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
        loss = loss + kl_weight * (w * kl).sum()
        stats["kl"] = float(kl.detach().mean())
    ce = -logp_s.gather(-1, targets[:, None])[:, 0]
    if ce_weight:
        loss = loss + ce_weight * (w * ce).sum()
    stats["ce"] = float(ce.detach().mean())
    agree = logits_s.detach().argmax(-1) == logits_t.argmax(-1)
    stats["tail_agree"] = float(agree[is_tail].float().mean()) if bool(is_tail.any()) else math.nan
    stats["head_agree"] = float(agree[~is_tail].float().mean()) if bool((~is_tail).any()) else math.nan
    return loss / total_weight, stats


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
