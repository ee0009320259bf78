"""Which prompts a prefill step computes, and how far (torch-free): a part of :class:`dmtd.engine.scheduler.Scheduler`,
kept apart so the scheduler reads as admission, steps and retirement.

Where prompts run as rows (``free_split``: a prompt may be split anywhere with the same bits), every prompt that gets
its pages is admitted, then served least work first (:meth:`PrefillPlanning._prefill_order`); a step that takes
prompts whole holds one, or several up to ``STEP_KEYS`` of work, so the first ones answer while the rest go on; a
prompt of at most ``long_prefill_tokens`` is taken whole beside decoding, a longer one as the pacer's budget buys
(:mod:`dmtd.engine.prefill_pacer`); a prompt whose next chunk another prompt is computing waits and reads it. Elsewhere
(SDPA chunks) prompts come first come first served, a chunk of ``prefill_chunk`` positions a step beside decoding.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from dmtd.engine.prefill_pacer import end_within, prompt_cost
from dmtd.engine.sequence import Sequence

if TYPE_CHECKING:
    from dmtd.engine.kv_manager import KVCacheManager

__all__ = ["AGE_STEPS", "STEP_KEYS", "PrefillPlanning"]

# A prefill step that takes prompts whole (nothing decodes, or short prompts beside decoding) takes one, or several
# while together they are this much work at most (keys read, ~0.25 s on two cores: 16 chat prompts start together,
# in phase; a system prompt of 1,000 tokens is a step of its own).
STEP_KEYS = 1 << 18
# A waiting prompt's age, in schedule() calls, that halves the work its order counts (_prefill_order).
AGE_STEPS = 64


class PrefillPlanning:
    """A mixin of the scheduler: its prefill step's plan."""

    kv: KVCacheManager
    waiting: deque[Sequence]
    prefilling: list[Sequence]
    running: list[Sequence]
    free_split: bool
    align_phases: bool
    prefill_chunk: int
    max_prefill_tokens: int
    long_prefill_tokens: int
    num_schedules: int
    queued_at: dict[int, int]
    last_prefill_keys: float

    if TYPE_CHECKING:  # the scheduler's own
        def _admit(self, seq: Sequence) -> bool: ...

    def _plan_prefill(self, prefill: list[Sequence], paced: bool, keys: float) -> None:
        """The prompts this step computes into ``prefill`` (the step's), each planned to its end (``kv.plan_prefill``);
        ``paced``: sequences decode beside it and ``keys`` is the work the pacer grants the step."""
        C = self.prefill_chunk
        budget = C if self.running else self.max_prefill_tokens
        if self.free_split:  # every prompt that gets its pages now is admitted, then served in _prefill_order
            while self.waiting and self.kv.fits(self.waiting[0], len(self.running) + len(self.prefilling)):
                if not self._admit(self.waiting.popleft()):
                    break
            for s in self.prefilling:  # chunks published since its admission count as done
                self.kv.reuse(s)
            queue = sorted(self.prefilling, key=self._prefill_order)
        else:
            queue = list(self.prefilling)
        # prompts admitted together start decoding together where a dmtd-profile row's phases follow the shared
        # clock (its tokens then are those it gets alone); exact rows' tokens do not depend on when they start
        stagger = self.free_split and (not self.align_phases or all(q.params.exact for q in queue))
        # prompt chunks another prompt is computing: those begun, and those planned in this step
        claimed = {k for s in self.prefilling if s.num_prefilled > s.num_cached_tokens
                   for k in self.kv.chunks_ahead(s)}
        while budget > 0:
            if queue:
                seq = queue.pop(0)
            elif self.waiting and self.kv.fits(self.waiting[0], len(self.running) + len(self.prefilling)):
                seq = self.waiting.popleft()
                if not self._admit(seq):
                    break
            else:
                break
            if self._computing_elsewhere(seq, claimed):
                continue  # its next chunk is another prompt's: it waits, then reads it (kv.reuse)
            target = seq.resume_len or seq.num_tokens
            left = target - seq.num_prefilled
            whole = self.free_split and (not paced or self._short(seq))
            if (whole and stagger and prefill
                    and self.last_prefill_keys + prompt_cost(seq.num_prefilled, target) > STEP_KEYS):
                break  # a step holds one prompt, or short ones up to STEP_KEYS: it answers none of them before
                # its end, so the first ones start while the rest go on
            if paced and whole:  # a short prompt whole, now: the first whatever its cost, more while they fit
                if prefill and prompt_cost(seq.num_prefilled, target) > keys:
                    break
                end = target
                keys -= prompt_cost(seq.num_prefilled, end)
            elif paced:  # what fits the step's budget, anywhere (at least one position)
                if prefill and prompt_cost(seq.num_prefilled, seq.num_prefilled + 1) > keys:
                    break
                end = end_within(seq.num_prefilled, target, keys)
                keys -= prompt_cost(seq.num_prefilled, end)
                budget = 1 if keys > 0 else 0
            elif left <= budget or self.free_split:
                end = seq.num_prefilled + min(left, budget)
            else:
                end = seq.num_prefilled + budget // C * C
            if end == seq.num_prefilled:
                break
            self.kv.plan_prefill(seq, end)
            self.last_prefill_keys += prompt_cost(seq.num_prefilled, end)
            claimed.update(self.kv.chunks_ahead(seq))
            if not paced:
                budget -= end - seq.num_prefilled
            prefill.append(seq)

    def _short_due(self, paced: bool) -> bool:
        """A short prompt is waiting beside decoding: it waits for no pacing credit (it still alternates with decode
        steps)."""
        return paced and (any(map(self._short, self.prefilling))
                          or bool(self.waiting and self._short(self.waiting[0])))

    def _prefill_order(self, seq: Sequence) -> float:
        """Which admitted prompt a prefill step serves first, lowest first: the work left of it (keys read,
        :func:`prompt_cost`) over one plus its age in steps / ``AGE_STEPS`` — the shortest first (a prompt whose
        prefix is cached before one computed whole: the least mean time to first token), and none waits for ever
        behind later short ones."""
        left = prompt_cost(seq.num_prefilled, seq.resume_len or seq.num_tokens)
        return left / (1.0 + (self.num_schedules - self.queued_at[seq.seq_no]) / AGE_STEPS)

    def _short(self, seq: Sequence) -> bool:
        """A prompt of at most ``long_prefill_tokens`` positions to compute: while others decode it is prefilled whole
        at the next chance (a gap of its prefill in their streams), not paced beside them as a long one is."""
        return 0 < (seq.resume_len or seq.num_tokens) <= self.long_prefill_tokens

    def _computing_elsewhere(self, seq: Sequence, claimed: set[bytes]) -> bool:
        """Whether ``seq`` has computed none of its prompt yet and its next chunk is one a prompt ahead of it is
        computing (the same system prompt arriving twice): it waits and reads that chunk's pages instead."""
        if seq.num_prefilled != seq.num_cached_tokens or seq.resume_len:
            return False
        ahead = self.kv.chunks_ahead(seq)
        return bool(ahead) and ahead[0] in claimed
