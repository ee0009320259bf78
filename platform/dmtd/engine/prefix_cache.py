"""Prompt KV kept in cache slots after its request, found again by a hash chain over chunk-sized token runs.

Prompts are prefilled in chunks whose boundaries sit at multiples of the chunk length from position 0
(:meth:`dmtd.engine.runner.ModelRunner.prefill`), so a chunk's KV is a function of the tokens up to its end alone:
a prompt that starts with the same whole chunks as one prefilled before gets their KV bit for bit, whether it
copies them or computes them. Each whole prompt chunk a slot holds is published under
``hash(previous chunk's key, salt, its tokens)``; the salt names what else the KV depends on inside one engine
(whether the verifying path wrote its decoding group too, and τ where heads sit at absolute positions).
A finished request's slot keeps its entries while it is free; a new sequence takes an empty slot first, then the
least recently freed one (its entries are dropped). A request whose prompt's first chunks are in a free slot
takes that slot and computes only the rest; in a slot still in use (a shared system prompt of concurrent
requests), they are copied into its own. Torch-free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


def chain(tokens: list[int], chunk: int, salt: str, limit: int | None = None) -> list[bytes]:
    """The keys of ``tokens``' whole chunks (at most ``limit``), each covering every token up to its end."""
    keys: list[bytes] = []
    prev = salt.encode()
    n = len(tokens) // chunk if limit is None else min(limit, len(tokens) // chunk)
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[i * chunk: (i + 1) * chunk]))
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass(slots=True)
class PrefixStats:
    lookups: int = 0
    hits: int = 0  # lookups that found at least one chunk
    prompt_tokens: int = 0  # prompt tokens of the looked-up requests
    cached_tokens: int = 0  # of them, not computed (taken or copied)
    copied_tokens: int = 0  # of those, copied from a slot in use
    evicted_chunks: int = 0


@dataclass(slots=True)
class PrefixCache:
    """Which slot holds which prompt chunks; the free slots that still hold some, least recently freed first."""

    chunk: int
    entries: dict[bytes, int] = field(default_factory=dict)  # chunk key → slot
    held: dict[int, list[bytes]] = field(default_factory=dict)  # slot → its chunk keys, in order
    free_held: OrderedDict[int, None] = field(default_factory=OrderedDict)
    stats: PrefixStats = field(default_factory=PrefixStats)

    def lookup(self, keys: list[bytes]) -> tuple[int, int]:
        """The slot holding the most of these leading chunks and how many (-1, 0: none)."""
        for i in range(len(keys) - 1, -1, -1):
            slot = self.entries.get(keys[i])
            if slot is not None:
                return slot, i + 1
        return -1, 0

    def publish(self, slot: int, keys: list[bytes]) -> None:
        """``slot`` now holds the chunks ``keys`` (its whole prompt chunks so far, in order)."""
        have = self.held.setdefault(slot, [])
        for k in keys[len(have):]:
            have.append(k)
            self.entries[k] = slot  # the newest holder: it stays longest

    def truncate(self, slot: int, num_chunks: int) -> None:
        """``slot`` keeps only its first ``num_chunks`` chunks (the rest are about to be overwritten)."""
        have = self.held.get(slot, [])
        for k in have[num_chunks:]:
            if self.entries.get(k) == slot:
                del self.entries[k]
            self.stats.evicted_chunks += 1
        del have[num_chunks:]
        if not have:
            self.held.pop(slot, None)

    def released(self, slot: int) -> bool:
        """A slot's request ended: the slot is free and keeps its chunks (True) or holds none (False)."""
        if self.held.get(slot):
            self.free_held[slot] = None
            return True
        return False

    def taken(self, slot: int) -> None:
        """A free slot is in use again (whatever it keeps was truncated first)."""
        self.free_held.pop(slot, None)

    def oldest_free(self) -> int | None:
        return next(iter(self.free_held), None)

    @property
    def num_cached_chunks(self) -> int:
        return len(self.entries)

    def report(self) -> dict[str, float]:
        """The counters as a replica reports them: lookups, hits, prompt and cached tokens, the cached share."""
        st = self.stats
        return {"prefix_lookups": st.lookups, "prefix_hits": st.hits, "prefix_prompt_tokens": st.prompt_tokens,
                "prefix_cached_tokens": st.cached_tokens,
                "prefix_hit_ratio": st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
                "prefix_cached_chunks": self.num_cached_chunks}
