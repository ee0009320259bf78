"""Drafting and checking in verified cycles: the speculative-sampling rule (Leviathan et al., Chen et al.).

A draft ``d`` sampled from the tail's distribution ``q`` is accepted with probability
``min(1, p(d) / q(d))`` under the verifier's distribution ``p``; the first rejected position takes a
token drawn from the normalised ``max(0, p − q)``; when every draft is accepted the head's own
prediction is a bonus token drawn from ``p``. The emitted tokens are then distributed exactly as the
verifier's own sampling would be. Greedy requests are the limit: accept while the draft equals the
verifier's argmax, then take the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dmtd.engine.lowbit import kernels_loaded
from dmtd.engine.sampler import draw, filtered_probs
from dmtd.engine.sequence import SamplingParams


@dataclass(slots=True)
class Drafts:
    """One draft step's picks: token ids, the tail's top-1 probabilities, and ``q`` rows for sampled rows."""

    tokens: list[int]
    confidences: list[float]
    finite: list[bool]
    q: list[torch.Tensor | None]  # [N] over the draft vocabulary, None for greedy rows


def top1(logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Each row's first argmax and its softmax probability (NaN for a row with a NaN or no finite logit): one pass
    of ``dmtd::top1`` where the kernels are loaded (a draft step's picking was ~7 % of the step), else torch's."""
    if logits.device.type == "cpu" and kernels_loaded():
        idx, top = torch.ops.dmtd.top1(logits)
        return idx.tolist(), top
    logits = logits.float()
    return logits.argmax(dim=-1).tolist(), torch.softmax(logits, dim=-1).amax(dim=-1)


def pick_drafts(logits: torch.Tensor, vocab: torch.Tensor | None, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> Drafts:
    """Draft one token per row from the tail head's logits [n, N] (N = the draft vocabulary's size)."""
    idx, top = top1(logits)
    tops = top.tolist()
    finite = [math.isfinite(t) for t in tops]  # top is NaN for a row with a NaN or no finite logit
    q: list[torch.Tensor | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if not p.greedy and finite[i]]
    if rows:
        probs = filtered_probs(logits.float()[torch.tensor(rows, device=logits.device)], [params[i] for i in rows])
        for j, (i, t) in enumerate(zip(rows, draw(probs, [generators[i] for i in rows]))):
            idx[i], q[i] = t, probs[j]
    tokens = idx if vocab is None else vocab[torch.tensor(idx, device=vocab.device)].tolist()
    return Drafts(tokens, [t if ok else 0.0 for t, ok in zip(tops, finite)], finite, q)


@dataclass(slots=True)
class Checked:
    """The outcome of one head's check for one row."""

    tokens: list[int]  # accepted drafts, then the verifier's token
    num_accepted: int
    confidences: list[float]  # the verifier's top-1 probability at each emitted token's position
    finite: bool


def check_drafts(logits: torch.Tensor, drafts: list[int], q: list[torch.Tensor | None],
                 vocab: torch.Tensor | None, params: SamplingParams,
                 generator: torch.Generator | None) -> Checked:
    """Accept the longest admissible prefix of ``drafts`` against the verifier's logits [m + 1, V]."""
    m = len(drafts)
    target, top = top1(logits)
    confs = top.tolist()
    if not all(math.isfinite(c) for c in confs):
        return Checked([], 0, [], False)
    if params.greedy:
        a = 0
        while a < m and drafts[a] == target[a]:
            a += 1
        return Checked(drafts[:a] + [target[a]], a, confs[: a + 1], True)
    p = filtered_probs(logits.float(), [params] * (m + 1))
    dev = p.device
    for j in range(m):
        qj = _full(q[j], vocab, p.shape[-1], dev)
        d = drafts[j]
        u = float(torch.rand(1, generator=generator, device=dev))
        if u * float(qj[d]) < float(p[j, d]):
            continue
        residual = (p[j] - qj).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the draft was as good as any
            residual = p[j]
        tok = draw(residual[None], [generator])[0]
        return Checked(drafts[:j] + [tok], j, confs[: j + 1], True)
    return Checked(drafts + draw(p[m:], [generator]), m, confs, True)


def _full(q: torch.Tensor | None, vocab: torch.Tensor | None, size: int, dev: torch.device) -> torch.Tensor:
    assert q is not None, "a sampled row keeps its draft distribution"
    if vocab is None or q.shape[-1] == size:  # over the whole vocabulary already (a grammar's forced token)
        return q
    return torch.zeros(size, dtype=q.dtype, device=dev).index_copy_(0, vocab, q)
