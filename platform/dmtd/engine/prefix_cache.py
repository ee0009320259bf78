"""Prompt KV shared by reference: the pages of whole prefill chunks, found again by a hash chain over chunk-sized
token runs.

Prompts are prefilled in chunks whose boundaries sit at multiples of the chunk length from position 0
(:meth:`dmtd.engine.runner.ModelRunner.prefill`), so a chunk's KV is a function of the tokens up to its end alone:
a prompt that starts with the same whole chunks as one prefilled before gets their KV bit for bit, whether it reads
them or computes them. Each whole prompt chunk is published under ``hash(previous chunk's key, salt, its tokens)``
with the pages that hold it (a chunk is a whole number of pages); the salt names what else the KV depends on inside
one engine (whether the verifying path wrote its decoding group too, and τ where heads sit at absolute positions).
A new sequence whose prompt starts with published chunks puts their pages at the head of its page table — shared,
never written again (a sequence writes only positions past its prompt's cached part) — and computes the rest.
A finished sequence's answer is published the same way (:meth:`dmtd.engine.kv_manager.KVCacheManager.release`)
where the engine computes a generated position's KV as a prefill of the same tokens would, so a conversation's next
turn prefills only its new message. Published chunks outlive their sequences; when the pool needs pages, the least
recently used chunk that no running sequence holds is dropped (a chain's later chunks before its earlier ones).
Torch-free.
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
    cached_tokens: int = 0  # of them, read from shared pages, not computed
    evicted_chunks: int = 0


@dataclass(slots=True)
class PrefixCache:
    """Published chunks and their pages, least recently used first."""

    chunk: int
    entries: OrderedDict[bytes, tuple[int, ...]] = field(default_factory=OrderedDict)  # chunk key → its pages
    stats: PrefixStats = field(default_factory=PrefixStats)

    def lookup(self, keys: list[bytes]) -> tuple[int, list[int]]:
        """How many leading chunks of ``keys`` are published, and their pages in order; they become the most
        recently used, the first chunk most of all (a chain is dropped from its end)."""
        pages: list[int] = []
        n = 0
        for k in keys:
            got = self.entries.get(k)
            if got is None:
                break
            pages.extend(got)
            n += 1
        for k in reversed(keys[:n]):
            self.entries.move_to_end(k)
        return n, pages

    def publish(self, keys: list[bytes], pages: list[int]) -> list[int]:
        """Chunks ``keys`` (a prompt's first whole chunks, in order) are held by ``pages`` (the first pages of the
        sequence's table, as many for each chunk); returns the pages newly published. A chunk published already
        keeps the pages it has."""
        per = len(pages) // len(keys) if keys else 0
        new: list[int] = []
        for i, k in enumerate(keys):
            if k not in self.entries:
                got = tuple(pages[i * per: (i + 1) * per])
                self.entries[k] = got
                new.extend(got)
        return new

    def evict(self, held: list[int]) -> list[int]:
        """Drop the least recently used chunk none of whose pages a sequence holds (``held``: rows holding each
        page); returns its pages (none: nothing can go)."""
        for k, pages in self.entries.items():
            if all(held[p] == 0 for p in pages):
                del self.entries[k]
                self.stats.evicted_chunks += 1
                return list(pages)
        return []

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
