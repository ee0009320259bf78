"""Pricing the pass-free draft sources (dmtd.engine.draft_sources: prompt lookup, the phrase table) against the tails:
a cycle's drafts may be a source's tokens where the draft policy expects more tokens per cost of them than of the
tails' drafts; the table may also go on from the tails' drafts. Torch-free; the engine (dmtd.engine.verified)
calls these at each head."""

from __future__ import annotations

from dmtd.engine.draft_policy import PassCosts, acceptance_by_pos, expected_tokens
from dmtd.engine.draft_sources import Counts, DraftSource
from dmtd.engine.sequence import Sequence

# context drafts a cycle at most: a check of 4 positions is one pass over the weights on AVX2 (4 rows a pass; 5
# positions cost ~1.8 plain steps, 4 ~1.3, 2 ~1.05); a longer repeat is taken over several cycles
MAX_CONTEXT_DRAFTS = 3


def _less(counts: list[int], mine: list[int]) -> list[int]:
    """Engine-wide counts by position less one request's (never below 0: the engine's are halved now and then)."""
    return [max(0, x - (mine[j] if j < len(mine) else 0)) for j, x in enumerate(counts)]


def candidates(seq: Sequence, most: int, sources: list[DraftSource]) -> list[tuple[str, list[int]]]:
    """(source name, up to ``most`` tokens) a cycle could draft without the tails, one per source. Each source
    learns its acceptance only when it is taken: the 2-token match, competing with the 3-token one where both
    existed, won its first draws on one engine, and the 3-token one (0.78 right against 0.66) was never taken again
    (prompt lookup proposes its longest match only)."""
    return [p for p in (src.propose(seq, most) for src in sources) if p is not None]


def choose(seq: Sequence, seen: Counts, costs: PassCosts, batch: int, bar: float, most: int,
           eos_ids: set[int], sources: list[DraftSource]) -> tuple[list[int], str]:
    """The continuation (up to ``most`` tokens, of a pass-free source) and its source with the most expected tokens
    per check cost, if that beats ``bar`` (the tails' best rate); else ``([], "")``. A request's own
    acceptance by position (per source) is smoothed toward what the engine saw on its other requests (``seen``,
    this one's counts taken out)."""
    pick: list[int] = []
    best, source = bar, ""
    for name, cont in candidates(seq, most, sources):
        cont = until_stop(seq, cont, eos_ids)
        drafted, accepted = seq.draft.context_by_pos.get(name, ([], []))
        seen_d, seen_a = seen.get(name, ([], []))
        prior = acceptance_by_pos(_less(seen_a, accepted), _less(seen_d, drafted), MAX_CONTEXT_DRAFTS)
        for m in range(1, len(cont) + 1):
            rate = expected_tokens(accepted, drafted, m, prior) / costs.check_cost(batch, m)
            if rate > best:
                pick, best, source = cont[:m], rate, name
    return pick, source


def until_stop(seq: Sequence, cont: list[int], eos_ids: set[int]) -> list[int]:
    """``cont`` up to its first stop token (kept: it ends the request; nothing after it is worth checking)."""
    for j, t in enumerate(cont):
        if seq.stops_at(t, eos_ids):
            return cont[: j + 1]
    return cont


def extension(seq: Sequence, seen: Counts, costs: PassCosts, batch: int, cont: list[int], source: str) -> list[int]:
    """How much of ``cont`` (the phrase table's continuation of the tails' drafts) to check after them: the prefix
    with the most expected tokens per cycle cost, if that beats the tails' drafts alone, else none. The tokens
    count only where every tail draft is accepted; they cost the check's wider rows, no pass."""
    m = len(seq.draft.tokens)
    reach = 1.0
    for a in acceptance_by_pos(seq.draft.accepted_by_pos, seq.draft.drafted_by_pos, m):
        reach *= a
    tokens, cost = expected_tokens(seq.draft.accepted_by_pos, seq.draft.drafted_by_pos, m), costs.cycle_cost(batch, m)
    drafted, accepted = seq.draft.context_by_pos.get(source, ([], []))
    seen_d, seen_a = seen.get(source, ([], []))
    prior = acceptance_by_pos(_less(seen_a, accepted), _less(seen_d, drafted), MAX_CONTEXT_DRAFTS)
    pick: list[int] = []
    best = tokens / cost
    for j in range(1, len(cont) + 1):
        more = reach * (expected_tokens(accepted, drafted, j, prior) - 1)
        # a width measured and a wider one still on its prior could make the difference negative: never below free
        wider = max(0.0, costs.check_cost(batch, m + j) - costs.check_cost(batch, m))
        rate = (tokens + more) / (cost + wider)
        if rate > best:
            pick, best = cont[:j], rate
    return pick
