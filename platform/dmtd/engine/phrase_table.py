"""A variant's phrase table: which token the base model's answers in its training corpus put after a 3-token
context, kept where one token had most of the continuations (REST-style retrieval drafts, arXiv 2311.08252). The
engine drafts from it like from the prompt (dmtd.engine.context_drafts): a table draft costs no tail pass, only the
check's wider rows, and the check keeps the output the verifier's. Torch-free; the file is read by
dmtd.variants.build and written by ``dmtd phrase-table`` (dmtd.train.phrase_table)."""

from __future__ import annotations

from dataclasses import dataclass, field

PHRASE_TABLE_FORMAT = "dmtd-phrase-table-v1"  # safetensors: keys (int64, packed contexts), next (int32), share (uint8)
N = 3  # context tokens a lookup keys on
# the table's sources for the draft policy, by the share of the first draft's context: its acceptance is counted
# apart from the prompt's n-grams (n in CONTEXT_NGRAMS, all positive) and per share band (and apart again where the
# table goes on from the tails' drafts: extension_source)
SOURCES = {-1: 0.8, -2: 0.0}  # source → lowest share (percent / 100) of the first token's context



def extension_source(source: int) -> int:
    """The source key under which a band's tokens count when they go on from the tails' drafts (their acceptance
    is conditional on the tails' being accepted, not that of a cycle drafted from the table alone)."""
    return source - len(SOURCES)


@dataclass(slots=True)
class PhraseTable:
    """Context (N token ids, packed) → (next token id, share of the context's continuations in percent)."""

    vocab_size: int
    entries: dict[int, tuple[int, int]] = field(default_factory=dict)

    def key(self, ctx: list[int] | tuple[int, ...]) -> int:
        k = 0
        for t in ctx:
            k = k * self.vocab_size + t
        return k

    def continuation(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens chained from the table after ``ids`` (each one's context: the N tokens before it) and
        the source of the first one's share band; ``([], 0)`` where the context is not in the table."""
        if k <= 0 or len(ids) < N:
            return [], 0
        ctx = list(ids[-N:])
        out: list[int] = []
        source = 0
        while len(out) < k:
            hit = self.entries.get(self.key(ctx))
            if hit is None:
                break
            tok, share = hit
            if not out:
                source = next(s for s, low in SOURCES.items() if share >= low * 100)
            out.append(tok)
            ctx = ctx[1:] + [tok]
        return out, source

    def __len__(self) -> int:
        return len(self.entries)
