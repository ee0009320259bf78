"""Where a verified cycle's drafts come from, and how their acceptance is counted — once, by source name.

A cycle's drafts are a run of tokens, each with the name of the source that proposed it (``DraftState.sources``):
the tails (``TAILS``, the DMTD decoding layers' own drafts, made by draft passes), prompt lookup (``lookup3``,
``lookup2``: what followed the latest earlier occurrence of the context's last n tokens), the variant's phrase table
(``phrase3-high``, ``phrase3-low``, ``phrase2``, and ``…+tails`` where it goes on from the tails' drafts) and a
grammar's forced tokens (``forced``). A source that proposes without a model pass is a :class:`DraftSource`:
``propose`` gives its tokens under the name their acceptance is counted by; the engine prices them against the
tails' (dmtd.engine.context_drafts) and the next head checks them all alike. :class:`DraftLedger` counts a checked
cycle once: the sequence's totals and acceptance by position per source (what the draft policy reads), and the
engine-wide counts a new request starts from. Adding a source: a class here and its place in
:func:`context_sources`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dmtd.engine.draft_policy import count_cycle
from dmtd.engine.draft_state import CONTEXT_NGRAMS
from dmtd.engine.phrase_table import N, PhraseTable
from dmtd.engine.sequence import Sequence

TAILS = "tails"  # the DMTD tails' drafts (draft passes)
FORCED = "forced"  # a grammar's forced tokens (dmtd.engine.logits_process)
LOOKUPS = {n: f"lookup{n}" for n in CONTEXT_NGRAMS}  # prompt lookup by the n of its match

# source name → (drafted, accepted) by position within the source's run of drafts
Counts = dict[str, tuple[list[int], list[int]]]


def after_tails(name: str) -> str:
    """The name a source's tokens count under where they go on from the tails' drafts: their acceptance is
    conditional on the tails' being accepted, not that of a cycle the source drafted alone."""
    return f"{name}+{TAILS}"


class DraftSource(Protocol):
    """A source of drafts that costs no model pass (the check's wider rows only)."""

    def propose(self, seq: Sequence, most: int) -> tuple[str, list[int]] | None:
        """Up to ``most`` tokens to draft next, under the source name their acceptance is counted by; or None."""


class PromptLookup:
    """The prompt's and answer's own continuation of their last n tokens (the longest n in CONTEXT_NGRAMS that
    matches: a shorter match is the same or a worse guess)."""

    def propose(self, seq: Sequence, most: int) -> tuple[str, list[int]] | None:
        for n in CONTEXT_NGRAMS:  # longest first
            cont = seq.context_continuation(most, n)
            if cont:
                return LOOKUPS[n], cont
        return None


@dataclass
class PhraseTableDrafts:
    """The variant's phrase table's continuation of the context (dmtd.engine.phrase_table), named by the table's
    band of its first token; :meth:`extend` goes on from the tails' drafts instead."""

    table: PhraseTable

    def propose(self, seq: Sequence, most: int) -> tuple[str, list[int]] | None:
        cont, band = self.table.continuation(seq.token_ids, most)
        return (band, cont) if cont else None

    def extend(self, seq: Sequence, most: int) -> tuple[str, list[int]] | None:
        cont, band = self.table.continuation(seq.token_ids[-N:] + seq.draft.tokens, most)
        return (after_tails(band), cont) if cont else None


class TailStandIn(Protocol):
    """A stand-in for the tails' picks (the bench's oracle drafter, dmtd.bench.oracle_bench): the token a greedy
    request drafts in place of the tail's own ``token``, at its next draft (generated index ``seq.num_generated +
    len(seq.draft.tokens)``). The draft passes still run (their cost is the cycle's); the check still decides."""

    def replace(self, seq: Sequence, token: int) -> int:
        """The token to draft instead of ``token``."""


def context_sources(phrase: PhraseTableDrafts | None) -> list[DraftSource]:
    """The pass-free sources a greedy exact request's cycle may draft from, in the order they are tried."""
    return [PromptLookup(), *([phrase] if phrase is not None else [])]


def parts(sources: list[str]) -> list[tuple[str, int, int]]:
    """A cycle's drafts as runs: (source, first draft's index, count)."""
    out: list[tuple[str, int, int]] = []
    for j, name in enumerate(sources):
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1], out[-1][2] + 1)
        else:
            out.append((name, j, 1))
    return out


@dataclass
class DraftLedger:
    """Counts checked cycles: per sequence (totals, and acceptance by position per source) and engine-wide (the
    pass-free sources' acceptance over every request so far: a new request's prior — a 2-token match that is right
    1 time in 6 should not be tried a dozen times on every request to learn it)."""

    seen: Counts = field(default_factory=dict)

    def count(self, seq: Sequence, sources: list[str], accepted: int) -> tuple[int, int]:
        """Fold one checked cycle whose drafts came from ``sources`` (one name per draft) and whose first
        ``accepted`` drafts were emitted. A run after the first counts by position only where every draft before it
        was accepted. Returns the cycle's (drafted, accepted) drafts not from the tails."""
        st = seq.draft
        st.num_drafted += len(sources)
        st.num_accepted += accepted
        other_d = other_a = 0
        for name, start, n in parts(sources):
            got = max(0, min(accepted - start, n))
            if name != TAILS:
                other_d, other_a = other_d + n, other_a + got
            if start and accepted < start:
                continue
            if name == TAILS:
                count_cycle(st.drafted_by_pos, st.accepted_by_pos, n, got)
                continue
            d, a = st.context_by_pos.setdefault(name, ([], []))
            count_cycle(d, a, n, got)
            d, a = self.seen.setdefault(name, ([], []))
            count_cycle(d, a, n, got)
            if d and d[0] > 1000:  # halved past 1,000 cycles: they follow the workload
                d[:], a[:] = [x // 2 for x in d], [x // 2 for x in a]
        st.num_context_drafted += other_d
        st.num_context_accepted += other_a
        return other_d, other_a
