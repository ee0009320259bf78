"""Which prompts a prefill step computes, and how far (torch-free): the scheduler's :class:`PrefillPlanner`, given the
scheduler's queues and its admission, so the scheduler reads as admission, steps and retirement.

Where prompts run as rows (``free_split``: a prompt may be split anywhere with the same bits), every prompt that gets
its pages is admitted, then served least work first (:meth:`PrefillPlanner.order`); a step that takes
prompts whole holds one, or several up to ``STEP_KEYS`` of work, so the first ones answer while the rest go on; a
prompt of at most ``long_prefill_tokens`` is taken whole beside decoding, a longer one as the pacer's budget buys
(:mod:`dmtd.engine.prefill_pacer`); a prompt whose next chunk another prompt is computing waits and reads it. Elsewhere
(SDPA chunks) prompts come first come first served, a chunk of ``prefill_chunk`` positions a step beside decoding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from dmtd.engine.prefill_pacer import end_within, prompt_cost
from dmtd.engine.sequence import Sequence

if TYPE_CHECKING:
    from dmtd.engine.kv_manager import KVCacheManager

__all__ = ["AGE_STEPS", "STEP_KEYS", "PrefillPlanner"]

# A prefill step that takes prompts whole (nothing decodes, or short prompts beside decoding) takes one, or several
# while together they are this much work at most (keys read, ~0.25 s on two cores: 16 chat prompts start together,
# in phase; a system prompt of 1,000 tokens is a step of its own).
STEP_KEYS = 1 << 18
# A waiting prompt's age, in schedule() calls, that halves the work its order counts (_prefill_order).
AGE_STEPS = 64


class PrefillPlanner:
    """Plans a prefill step over the scheduler's queues (``waiting``, ``prefilling``, ``running``: the scheduler's
    own, shared), admitting a waiting prompt through ``admit`` (the scheduler's: a cache row and pages, else back to
    the queue's head). Keeps when each prompt was queued, in ``schedule()`` calls, for its order's ageing."""

    def __init__(self, *, kv: KVCacheManager, waiting: deque[Sequence], prefilling: list[Sequence],
                 running: list[Sequence], admit: Callable[[Sequence], bool], prefill_chunk: int,
                 max_prefill_tokens: int, long_prefill_tokens: int, align_phases: bool) -> None:
        self.kv = kv
        self.waiting, self.prefilling, self.running = waiting, prefilling, running
        self._admit = admit
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.long_prefill_tokens = long_prefill_tokens  # longer prompts are paced beside decoding; 0: all are
        self.align_phases = align_phases
        self.queued_at: dict[int, int] = {}  # seq_no → schedule() calls when it was queued (its order ages)

    def queued(self, seq: Sequence, num_schedules: int) -> None:
        """``seq`` joins the waiting queue at the ``num_schedules``-th schedule() call."""
        self.queued_at[seq.seq_no] = num_schedules

    def forget(self, seq: Sequence) -> None:
        self.queued_at.pop(seq.seq_no, None)

    def plan(self, prefill: list[Sequence], *, paced: bool, keys: float, free_split: bool,
             num_schedules: int) -> float:
        """The prompts this step computes into ``prefill`` (the step's), each planned to its end (``kv.plan_prefill``);
        ``paced``: sequences decode beside it and ``keys`` is the work the pacer grants the step; ``free_split``: a
        prompt may be split anywhere (prompts run as rows); ``num_schedules``: this step's schedule() call (the
        prompts' age). Returns the work planned (keys read)."""
        C = self.prefill_chunk
        planned = 0.0
        budget = C if self.running else self.max_prefill_tokens
        if free_split:  # every prompt that gets its pages now is admitted, then served in order()
            while self.waiting and self.kv.fits(self.waiting[0], len(self.running) + len(self.prefilling)):
                if not self._admit(self.waiting.popleft()):
                    break
            for s in self.prefilling:  # chunks published since its admission count as done
                self.kv.reuse(s)
            queue = sorted(self.prefilling, key=lambda q: self.order(q, num_schedules))
        else:
            queue = list(self.prefilling)
        # prompts admitted together start decoding together where a dmtd-profile row's phases follow the shared
        # clock (its tokens then are those it gets alone); exact rows' tokens do not depend on when they start
        stagger = free_split and (not self.align_phases or all(q.params.exact for q in queue))
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
            whole = free_split and (not paced or self._short(seq))
            if (whole and stagger and prefill
                    and planned + prompt_cost(seq.num_prefilled, target) > STEP_KEYS):
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
            elif left <= budget or free_split:
                end = seq.num_prefilled + min(left, budget)
            else:
                end = seq.num_prefilled + budget // C * C
            if end == seq.num_prefilled:
                break
            self.kv.plan_prefill(seq, end)
            planned += prompt_cost(seq.num_prefilled, end)
            claimed.update(self.kv.chunks_ahead(seq))
            if not paced:
                budget -= end - seq.num_prefilled
            prefill.append(seq)
        return planned

    def short_due(self, paced: bool) -> bool:
        """A short prompt is waiting beside decoding: it waits for no pacing credit (it still alternates with decode
        steps)."""
        return paced and (any(map(self._short, self.prefilling))
                          or bool(self.waiting and self._short(self.waiting[0])))

    def order(self, seq: Sequence, num_schedules: int) -> float:
        """Which admitted prompt a prefill step serves first, lowest first: the work left of it (keys read,
        :func:`prompt_cost`) over one plus its age in steps / ``AGE_STEPS`` — the shortest first (a prompt whose
        prefix is cached before one computed whole: the least mean time to first token), and none waits for ever
        behind later short ones."""
        left = prompt_cost(seq.num_prefilled, seq.resume_len or seq.num_tokens)
        return left / (1.0 + (num_schedules - self.queued_at[seq.seq_no]) / AGE_STEPS)

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
