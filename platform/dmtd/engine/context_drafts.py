"""Context drafts of verified cycles (prompt lookup): a cycle's drafts may be the tokens that followed the latest
earlier occurrence of the context's last few tokens, where the draft policy expects more tokens per cost of them than
of the tails' drafts. Torch-free; the engine (dmtd.engine.llm) calls these at each head."""

from __future__ import annotations

from dmtd.engine.draft_policy import PassCosts, acceptance_by_pos, count_cycle, expected_tokens
from dmtd.engine.sequence import CONTEXT_NGRAMS, Sequence

# context drafts a cycle at most: a check of 4 positions is one pass over the weights on AVX2 (4 rows a pass; 5
# positions cost ~1.8 plain steps, 4 ~1.3, 2 ~1.05); a longer repeat is taken over several cycles
MAX_CONTEXT_DRAFTS = 3

# n → (drafted, accepted) by position over an engine's requests
Counts = dict[int, tuple[list[int], list[int]]]


def _less(counts: list[int], mine: list[int]) -> list[int]:
    """Engine-wide counts by position less one request's (never below 0: the engine's are halved now and then)."""
    return [max(0, x - (mine[j] if j < len(mine) else 0)) for j, x in enumerate(counts)]


def choose(seq: Sequence, seen: Counts, costs: PassCosts, batch: int, bar: float, most: int,
           eos_ids: set[int]) -> tuple[list[int], int]:
    """The context continuation (up to ``most`` tokens) and its n with the most expected tokens per check cost, if
    that beats ``bar`` (the tails' best rate); else ``([], 0)``. A request's own acceptance by position (per n) is
    smoothed toward what the engine saw on its other requests (``seen``, this one's counts taken out)."""
    pick: list[int] = []
    best, ngram = bar, 0
    for n in CONTEXT_NGRAMS:
        cont = seq.context_continuation(most, n)
        for j, t in enumerate(cont):  # nothing past a stop token: it would end the request
            if t in seq.params.stop_token_ids or (not seq.params.ignore_eos and t in eos_ids):
                cont = cont[: j + 1]
                break
        drafted, accepted = seq.context_by_pos.get(n, ([], []))
        seen_d, seen_a = seen.get(n, ([], []))
        prior = acceptance_by_pos(_less(seen_a, accepted), _less(seen_d, drafted), MAX_CONTEXT_DRAFTS)
        for m in range(1, len(cont) + 1):
            rate = expected_tokens(accepted, drafted, m, prior) / costs.check_cost(batch, m)
            if rate > best:
                pick, best, ngram = cont[:m], rate, n
    return pick, ngram


def count(seen: Counts, n: int, drafted: int, accepted: int) -> None:
    """Fold a context cycle into the engine-wide counts (halved past 1,000 cycles: they follow the workload)."""
    d, a = seen.setdefault(n, ([], []))
    count_cycle(d, a, drafted, accepted)
    if d and d[0] > 1000:
        d[:], a[:] = [x // 2 for x in d], [x // 2 for x in a]
