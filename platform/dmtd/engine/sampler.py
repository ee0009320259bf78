"""Per-row sampling (greedy, temperature, top-k, top-p, seeded) and top-1 confidence."""

from __future__ import annotations

import torch

from dmtd.engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float], list[bool]]:
    """Pick one token per row of ``logits`` [B, V].

    Returns the tokens, the model's top-1 probability per row (the DMTD confidence, taken from the
    untempered distribution) and, per row, whether the logits were finite.
    """
    logits = logits.float()
    greedy_tok = logits.argmax(dim=-1)
    # softmax turns any NaN / +inf / all -inf row into NaN, so its max doubles as the finiteness check
    conf = torch.softmax(logits, dim=-1).amax(dim=-1)
    finite = torch.isfinite(conf)
    conf = conf.nan_to_num(0.0)
    tokens = greedy_tok.tolist()
    safe = logits
    for i, p in enumerate(params):
        if p.greedy or not bool(finite[i]):
            continue
        row = torch.nan_to_num(safe[i]) / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p
            row = row.scatter(0, idx, sorted_logits.masked_fill(drop, float("-inf")))
        tokens[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=generators[i]))
    return tokens, conf.tolist(), finite.tolist()
