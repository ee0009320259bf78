"""The KV cache manager (torch-free): which cache row and which KV pages each sequence holds, how far each layer
group's KV of it reaches, and the prefix cache.

The scheduler decides who runs; it asks the manager for a sequence's row and pages (admission, growth before a step,
release) and tells it what a step computed (a prompt chunk, a head, a draft, a check); the manager answers from the
page pool (:mod:`dmtd.engine.kv_pages`) and the published prompt chunks (:mod:`dmtd.engine.prefix_cache`) and keeps
the sequence's KV facts (``Sequence.kv_row``, ``num_prefilled`` / ``prefill_end`` / ``num_cached_tokens``, the
thinking group's ``num_think_cached``, the tail path's ``num_tail_cached``, ``resume_len``): nothing else writes
them (``tests/engine/test_kv_ownership.py``). The runner only reads them and the page table.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from dmtd.engine.config import ConfigError
from dmtd.engine.kv_pages import KVPages, pages_for
from dmtd.engine.prefix_cache import PrefixCache, chain
from dmtd.engine.sequence import RequestError, Sequence


class CapacityError(RequestError):
    """The request can never fit this engine (context length, KV pool)."""


class KVCacheManager:
    """Cache rows (one per running sequence: its row of the page table), pages, published prompt chunks."""

    def __init__(self, num_rows: int, max_model_len: int, lookahead: int, prefill_chunk: int, prefix_caching: bool,
                 pages: KVPages | None = None) -> None:
        self.pages = pages or KVPages(num_rows * pages_for(max_model_len, 16), 16, num_rows)
        self.max_model_len = max_model_len
        # positions past num_tokens that one decode step may write: a check of τ − 1 drafts, or the draft before it
        self.lookahead = lookahead
        self.chunk = prefill_chunk
        self.prefix = PrefixCache(prefill_chunk) if prefix_caching else None
        if self.prefix is not None:
            if prefill_chunk % self.pages.page_size:
                raise ConfigError(f"prefill_chunk ({prefill_chunk}) must be a multiple of page_size "
                                  f"({self.pages.page_size}) with prefix caching: a cached chunk is whole pages")
            self.pages.evictor = self.prefix.evict
        self._free_rows = list(range(num_rows))
        heapq.heapify(self._free_rows)
        # called with a sequence before its row and pages go (the runner writes KV it still owes them)
        self.before_release: Callable[[Sequence], None] | None = None
        # which sequences' generated positions hold the KV a prefill of their tokens would write, bit for bit, in
        # the groups a later request of the same salt reads (None: none; the engine decides, see reusable_len)
        self.answers: Callable[[Sequence], bool] | None = None
        self._salts: dict[int, str] = {}  # cache row → the salt of its sequence's chunk keys

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def check(self, seq: Sequence) -> None:
        """Refuse a request that can never fit: its prompt, or its prompt and ``max_new_tokens``, need more pages
        than the pool has."""
        P, total = self.pages.page_size, self.pages.num_pages
        if pages_for(min(seq.num_tokens + self.lookahead, self.max_model_len), P) > total:
            raise CapacityError("prompt", f"{seq.num_tokens} tokens need more than the KV pool's {total} pages of {P} "
                                "positions")
        longest = min(seq.num_tokens + seq.params.max_new_tokens + self.lookahead, self.max_model_len)
        if pages_for(longest, P) > total:
            raise CapacityError("max_new_tokens", f"{seq.num_tokens} prompt tokens and {seq.params.max_new_tokens} "
                                f"new ones need more than the KV pool's {total} pages of {P} positions")

    def fits(self, seq: Sequence, admitted: int) -> bool:
        """Whether a waiting sequence's prompt gets its pages now, a page of growth left for each of the
        ``admitted`` sequences."""
        need = pages_for(min(seq.num_tokens + self.lookahead, self.max_model_len), self.pages.page_size)
        return self.num_free_rows > 0 and need + admitted <= self.pages.num_free + self.pages.num_evictable

    def grow(self, seq: Sequence, positions: int) -> bool:
        """Pages for ``seq``'s positions ``0 .. positions - 1`` (cached chunks no sequence holds are dropped while
        too few are free); False if even that is not enough."""
        return self.pages.grow(seq.kv_row, min(positions, self.max_model_len))

    def admit(self, seq: Sequence, salt: str) -> bool:
        """A row for ``seq``, the pages of its prompt's leading chunks published before (shared), its own pages for
        the rest of its prompt and a step's growth; sets its row and how much of its prompt is cached. False
        (nothing held) if the pool cannot give them."""
        seq.kv_row = heapq.heappop(self._free_rows)
        n = 0
        if self.prefix is not None:
            # only prompt chunks are published or reused: a generated position's KV came from a decode step
            seq.prefix_keys = chain(seq.token_ids[: seq.prompt_len], self.chunk, salt)
            self._salts[seq.kv_row] = salt
            # at least the last prompt token is computed: its logits draw the first token
            n, shared = self.prefix.lookup(seq.prefix_keys[: (seq.num_tokens - 1) // self.chunk])
            self.pages.share(seq.kv_row, shared)
            if not seq.num_preempted:  # a preempted sequence's return is no new request
                st = self.prefix.stats
                st.lookups += 1
                st.hits += n > 0
                st.prompt_tokens += seq.num_tokens
                st.cached_tokens += n * self.chunk
        if not self.grow(seq, seq.num_tokens + self.lookahead):
            self.release(seq)
            return False
        seq.num_prefilled = seq.num_cached_tokens = n * self.chunk
        return True

    def admit_prefilled(self, seq: Sequence) -> bool:
        """A row and pages for a sequence whose prompt KV is copied in from a sibling's (dmtd.engine.forks)."""
        if not self.num_free_rows:
            return False
        seq.kv_row = heapq.heappop(self._free_rows)
        if not self.grow(seq, seq.num_tokens + self.lookahead):
            self.release(seq)
            return False
        return True

    def reuse(self, seq: Sequence) -> None:
        """Right before ``seq``'s chunks run: whole chunks past its prefilled ones that another sequence published
        since its admission (a prompt admitted beside one with the same prefix) replace its own pages for them."""
        if self.prefix is None or seq.num_prefilled != seq.num_cached_tokens:
            return  # only before its first computed chunk: after it, its own chunks are as good
        n, shared = self.prefix.lookup(seq.prefix_keys[: (seq.num_tokens - 1) // self.chunk])
        cached = n * self.chunk
        if cached <= seq.num_prefilled:
            return
        st = self.prefix.stats
        st.hits += seq.num_cached_tokens == 0
        st.cached_tokens += cached - seq.num_cached_tokens
        self.pages.shrink(seq.kv_row, 0)  # its own pages (nothing computed in them yet) go back, the shared come in
        self.pages.share(seq.kv_row, shared)
        grown = self.grow(seq, seq.num_tokens + self.lookahead)
        assert grown, "the pages it let go cover what it needs"
        seq.num_prefilled = seq.num_cached_tokens = cached
        seq.prefill_end = max(seq.prefill_end, cached)

    def chunks_ahead(self, seq: Sequence) -> list[bytes]:
        """The keys of ``seq``'s whole prompt chunks from its next position to compute on (none without a prefix
        cache)."""
        if self.prefix is None or not seq.prefix_keys:
            return []
        return seq.prefix_keys[seq.num_prefilled // self.chunk: (seq.num_tokens - 1) // self.chunk]

    def publish(self, seq: Sequence) -> None:
        """``seq``'s whole prompt chunks prefilled so far become findable (their pages cached)."""
        if self.prefix is None:
            return
        self._publish(seq, seq.prefix_keys[: seq.num_prefilled // self.chunk])

    def _publish(self, seq: Sequence, keys: list[bytes]) -> None:
        assert self.prefix is not None
        per = self.chunk // self.pages.page_size
        self.pages.cache(self.prefix.publish(keys, self.pages.tables[seq.kv_row][: len(keys) * per]))

    def reusable_len(self, seq: Sequence) -> int:
        """How many leading positions of ``seq`` hold the KV that a prefill of its tokens writes: its prompt's
        prefilled part, and where the engine says so (``answers``) its generated positions up to where every group
        a reader reads is written (the thinking group's refill and, for an unverified row, the tail path; the last
        token's KV is never computed)."""
        n = seq.num_prefilled
        if seq.num_generated and n >= seq.prompt_len and self.answers is not None and self.answers(seq):
            done = seq.num_think_cached if seq.params.exact else min(seq.num_think_cached, seq.num_tail_cached)
            n = max(n, min(done, seq.num_tokens - 1))
        return n

    def publish_answer(self, seq: Sequence) -> None:
        """``seq``'s whole chunks of prompt and answer that :meth:`reusable_len` vouches for become findable: the
        next turn of a conversation (this prompt, this answer, a new message) prefills only what is new."""
        if self.prefix is None or seq.kv_row < 0:
            return
        salt = self._salts.get(seq.kv_row)
        whole = self.reusable_len(seq) // self.chunk
        if salt is None or whole <= seq.num_prefilled // self.chunk:
            return
        self._publish(seq, chain(seq.token_ids[: whole * self.chunk], self.chunk, salt))

    # -- what a step computed: the sequence's fill levels, written here only -------------------------------------
    def plan_prefill(self, seq: Sequence, end: int) -> None:
        """The next prefill step computes ``seq``'s positions ``num_prefilled .. end - 1``."""
        seq.prefill_end = end

    def prefilled(self, seq: Sequence) -> bool:
        """After its prefill step: the chunk is in the cache (published where whole). True where that brought a
        preempted sequence back where it was (it decodes on, every group's KV up to there)."""
        seq.num_prefilled = seq.prefill_end
        self.publish(seq)
        if seq.resume_len and seq.num_prefilled == seq.resume_len:
            seq.num_think_cached = seq.num_tail_cached = seq.resume_len
            seq.resume_len = 0
            return True
        return False

    def copied_prompt(self, seq: Sequence) -> None:
        """A sibling's prompt KV was copied into ``seq``'s row (dmtd.engine.forks)."""
        seq.num_prefilled = seq.num_tokens

    def first_token(self, seq: Sequence) -> None:
        """The prompt's last position ran the full stack: every group's KV reaches the end of the prompt."""
        seq.num_think_cached = seq.num_tail_cached = seq.num_tokens

    def head(self, seq: Sequence, pos: int) -> None:
        """A head ran at ``pos`` (refilling the thinking group over the tails before it)."""
        seq.num_think_cached = pos + 1

    def drafted(self, seq: Sequence) -> None:
        """The tail path wrote its KV at the position its draft pass fed."""
        seq.num_tail_cached = seq.draft_position + 1

    def checked(self, seq: Sequence, head: int) -> None:
        """A check whose last token came from the verifier's logits at ``head``: the rejected drafts' KV is rewritten
        before it is read again, and the head's tail KV needs head routing."""
        seq.num_tail_cached = min(seq.num_tail_cached, head)
        seq.num_think_cached = head + 1

    def preempted(self, seq: Sequence) -> None:
        """``seq`` lets its row and pages go and will be prefilled again over its prompt and every token but its
        last (which the next step feeds as it would have); one preempted before its first token (its prompt partly
        prefilled) starts over as a new prompt."""
        self.release(seq)
        seq.num_prefilled = seq.prefill_end = 0
        seq.resume_len = seq.num_tokens - 1 if seq.num_generated else 0

    def release(self, seq: Sequence) -> None:
        """``seq`` lets its row and pages go (its published chunks stay cached)."""
        if seq.kv_row < 0:
            return
        if self.before_release is not None:
            self.before_release(seq)
        self.publish_answer(seq)
        self._salts.pop(seq.kv_row, None)
        self.pages.shrink(seq.kv_row, 0)
        heapq.heappush(self._free_rows, seq.kv_row)
        seq.kv_row = -1
