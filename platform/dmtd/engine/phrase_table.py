"""A variant's phrase table: which token the base model's answers in its training corpus put after a 3-token
context (else after a 2-token one), kept where one token had most of the continuations (REST-style retrieval
drafts, arXiv 2311.08252). The engine drafts from it like from the prompt (dmtd.engine.context_drafts): a table
draft costs no tail pass, only the check's wider rows, and the check keeps the output the verifier's. Torch-free;
the file is read by dmtd.variants.build and written by ``dmtd phrase-table`` (dmtd.train.phrase_table)."""

from __future__ import annotations

from dataclasses import dataclass, field

# safetensors: keys (int64, packed 3-token contexts), next (int32), share (uint8 percent); keys2 / next2 / share2
# the same for 2-token contexts; metadata: format, vocab_size
PHRASE_TABLE_FORMAT = "dmtd-phrase-table-v1"
N = 3  # context tokens a lookup keys on; N - 1 where the N-token context is not in the table
# the table's draft sources (dmtd.engine.draft_sources), by name: a 3-token context by the share of the first
# draft's continuation, or a 2-token one; each counted apart from prompt lookup, and apart again where the table
# goes on from the tails' drafts (draft_sources.after_tails)
LONG_HIGH, LONG_LOW, SHORT = "phrase3-high", "phrase3-low", "phrase2"
SOURCES = (LONG_HIGH, LONG_LOW, SHORT)
HIGH_SHARE = 80  # percent: a 3-token context's continuation at least this often is LONG_HIGH


def pack(ctx: list[int] | tuple[int, ...], vocab_size: int) -> int:
    k = 0
    for t in ctx:
        k = k * vocab_size + t
    return k


@dataclass(slots=True)
class PhraseTable:
    """Context (N, or N - 1, token ids, packed) → (next token id, share of the context's continuations in percent)."""

    vocab_size: int
    entries: dict[int, tuple[int, int]] = field(default_factory=dict)  # N-token contexts
    short: dict[int, tuple[int, int]] = field(default_factory=dict)  # (N - 1)-token contexts

    def key(self, ctx: list[int] | tuple[int, ...]) -> int:
        return pack(ctx, self.vocab_size)

    def lookup(self, ctx: list[int]) -> tuple[int, str] | None:
        """(next token, source) after the last N tokens of ``ctx``, else after its last N - 1, else None."""
        hit = self.entries.get(self.key(ctx[-N:])) if len(ctx) >= N else None
        if hit is not None:
            return hit[0], LONG_HIGH if hit[1] >= HIGH_SHARE else LONG_LOW
        hit = self.short.get(self.key(ctx[-(N - 1):])) if len(ctx) >= N - 1 else None
        return None if hit is None else (hit[0], SHORT)

    def continuation(self, ids: list[int], k: int) -> tuple[list[int], str]:
        """Up to ``k`` tokens chained from the table after ``ids`` (each one's context: the tokens before it) and
        the source of the first one; ``([], "")`` where the context is not in the table."""
        if k <= 0:
            return [], ""
        ctx = list(ids[-N:])
        out: list[int] = []
        source = ""
        while len(out) < k:
            hit = self.lookup(ctx)
            if hit is None:
                break
            if not out:
                source = hit[1]
            out.append(hit[0])
            ctx = ctx[1:] + [hit[0]] if len(ctx) >= N else ctx + [hit[0]]
        return out, source

    def __len__(self) -> int:
        return len(self.entries) + len(self.short)
