"""One sequence's verified-cycle state (the exact profile), in one record: this cycle's drafts (the tokens, the source
of each, their tail distributions), whether they await the next head's check, the draft count the policy chose, and
what its checks accepted so far. Written by the verified-cycles component (dmtd.engine.verified); the scheduler, the
runner's draft passes and the KV manager read it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# context drafts match the context's last 3 or 2 tokens (on the demo's chat prompts, τ = 1 answers, up to 4 drafts:
# 3 tokens matched 60 times in 735 tokens, 140 of 240 drafts right; 3 else 2: 90 matches, 169 of 360 right)
CONTEXT_NGRAMS = (3, 2)


@dataclass(slots=True)
class DraftState:
    """A sequence's drafts and their accounting (see the module)."""

    tokens: list[int] = field(default_factory=list)  # this cycle's unchecked drafts
    # the source of each draft (dmtd.engine.draft_sources: the tails, prompt lookup, the phrase table, a grammar's
    # forced tokens), one name per draft
    sources: list[str] = field(default_factory=list)
    q: list[Any] = field(default_factory=list)  # the tail's distribution of each pending draft (sampled requests)
    done: bool = False  # the drafts await the next head's check
    target: int | None = None  # this cycle's draft count chosen by the draft policy (None: τ − 1)
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_by_pos: list[int] = field(default_factory=list)  # per tail position within a cycle
    accepted_by_pos: list[int] = field(default_factory=list)
    num_context_drafted: int = 0  # every draft not from the tails (prompt lookup, the phrase table, forced tokens)
    num_context_accepted: int = 0
    context_by_pos: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # source → (drafted, accepted)
    context_vocab: set[int] = field(default_factory=set)  # context ids outside the draft vocabulary (runner's drafts)
    context_vocab_seen: int = 0  # token ids looked at for them so far
    ngram_ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram → index of its latest last token
    ngram_indexed: int = 0  # the n-grams ending before this index are in ngram_ends

    def add(self, tokens: list[int], source: str) -> None:
        """Append drafts proposed by ``source`` (dmtd.engine.draft_sources)."""
        self.tokens += tokens
        self.sources += [source] * len(tokens)

    def trim(self, m: int) -> None:
        """Keep the first ``m`` drafts."""
        del self.tokens[m:], self.sources[m:]

    def clear(self) -> None:
        """A new cycle: no drafts yet, drafting not done."""
        self.tokens, self.sources, self.q, self.done = [], [], [], False

    def context_continuation(self, ids: list[int], k: int, n: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last ``n`` tokens (``ids``:
        prompt and answer so far; ``n`` in CONTEXT_NGRAMS), or none. The index grows with the context: O(1) a call."""
        last = len(ids) - 1  # the n-grams ending before the last token: the suffix itself is not its own match
        for e in range(self.ngram_indexed, last):
            for m in CONTEXT_NGRAMS:
                if e >= m - 1:
                    self.ngram_ends[tuple(ids[e - m + 1: e + 1])] = e
        self.ngram_indexed = max(self.ngram_indexed, last)
        end = self.ngram_ends.get(tuple(ids[-n:])) if k > 0 and len(ids) >= n else None
        return [] if end is None else ids[end + 1: end + 1 + k]
