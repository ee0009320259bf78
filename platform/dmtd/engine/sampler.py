"""Per-row sampling (greedy, temperature, top-k, top-p, seeded) and top-1 confidence."""

from __future__ import annotations

import torch

from dmtd.engine.lowbit import kernels_loaded
from dmtd.engine.sequence import SamplingParams

_NUCLEUS_PROBE = 1024  # candidates ranked by topk before resorting to a full sort for top-p


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float], list[bool]]:
    """Pick one token per row of ``logits`` [B, V].

    Returns the tokens, the model's top-1 probability per row (the DMTD confidence, taken from the
    untempered distribution) and, per row, whether the logits were finite.
    """
    logits = logits.float()
    # softmax turns any NaN / +inf / all -inf row into NaN, so its max doubles as the finiteness check
    if logits.device.type == "cpu" and kernels_loaded():  # one pass over the logits (torch: argmax, then softmax)
        greedy_tok, conf = torch.ops.dmtd.top1(logits)
    else:
        greedy_tok, conf = logits.argmax(dim=-1), torch.softmax(logits, dim=-1).amax(dim=-1)
    finite = torch.isfinite(conf)
    conf = conf.nan_to_num(0.0)
    tokens = greedy_tok.tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy and bool(finite[i])]
    if rows:
        probs = filtered_probs(logits[torch.tensor(rows, device=logits.device)], [params[i] for i in rows])
        for i, t in zip(rows, draw(probs, [generators[i] for i in rows])):
            tokens[i] = t
    return tokens, conf.tolist(), finite.tolist()


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, then top-p. [B, V] -> [B, V]."""
    dev = logits.device
    x = torch.nan_to_num(logits.float())
    x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    ks = [min(p.top_k, x.shape[-1]) for p in params]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values
        k_idx = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None]
        cut = kth.gather(1, k_idx).masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None],
                                                float("-inf"))
        x = x.masked_fill(x < cut, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=dev)[:, None]
        # The nucleus nearly always lies in the top few hundred tokens: rank those with topk (much cheaper
        # than sorting the vocabulary) and fall back to a full sort only when some row's does not.
        k0 = min(x.shape[-1], _NUCLEUS_PROBE)
        sorted_logits, idx = torch.topk(x, k0, dim=-1)
        sp = torch.exp(sorted_logits - torch.logsumexp(x, dim=-1, keepdim=True))
        cum = sp.cumsum(-1)
        if k0 < x.shape[-1] and bool((cum[:, -1:] < top_p).any()):
            sorted_logits, idx = torch.sort(x, dim=-1, descending=True)
            sp = torch.softmax(sorted_logits, dim=-1)
            cum = sp.cumsum(-1)
        keep = sorted_logits.masked_fill(cum - sp >= top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, idx, keep)  # idx spans the whole nucleus
    return torch.softmax(x, dim=-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row by inverse CDF: one uniform from each row's own generator, one batched search.

    (``torch.multinomial`` per row cost ~25 ms for a 49k vocabulary on the 2-core CPU under load.)
    """
    dev = probs.device
    u = torch.cat([torch.rand(1, generator=g, device=dev) for g in generators])
    cdf = probs.cumsum(-1)
    # right=True: the first index whose CDF exceeds u·total — never a zero-probability token
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return idx.clamp(max=probs.shape[-1] - 1)[:, 0].tolist()
