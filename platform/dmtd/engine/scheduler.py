"""Continuous-batching scheduler (torch-free): admission, cache rows and their KV pages, chunked prefill, prefix reuse,
preemption, DMTD phases, blocks, retirement."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dmtd.engine.config import DMTDConfig
from dmtd.engine.draft_sources import TAILS
from dmtd.engine.kv_manager import CapacityError, KVCacheManager
from dmtd.engine.kv_pages import KVPages
from dmtd.engine.prefill_pacer import end_within, prompt_cost
from dmtd.engine.prefix_cache import PrefixCache
from dmtd.engine.sequence import RequestError, Sequence, SequenceStatus

__all__ = ["CapacityError", "Scheduler", "SchedulerOutput", "TokenEvent"]

# A prefill step that takes prompts whole (nothing decodes, or short prompts beside decoding) takes one, or several
# while together they are this much work at most (keys read, ~0.25 s on two cores: 16 chat prompts start together,
# in phase; a system prompt of 1,000 tokens is a step of its own).
STEP_KEYS = 1 << 18
# A waiting prompt's age, in schedule() calls, that halves the work its order counts (_prefill_order).
AGE_STEPS = 64


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs: either prompt chunks (each sequence's ``num_prefilled`` .. ``prefill_end``) or a decode
    batch (heads and tails mixed)."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    # prompt chunks that ride along with a decode step's check pass (their positions num_prefilled .. prefill_end)
    ride: list[Sequence] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefill or self.decode


@dataclass(slots=True)
class TokenEvent:
    """The result of one step for one sequence."""

    req_id: str
    token_id: int
    position: int  # position whose logits produced the token
    is_head: bool
    confidence: float
    block: list[int] | None = None  # set when this token completes a cycle's block (or a cut closes it)
    block_confidences: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None


class Scheduler:
    """Admits and retires sequences at any step; one KV-cache row (``kv_row``: a row of the page table) per sequence
    from its admission, and the KV pages of the positions it writes (:mod:`dmtd.engine.kv_pages`).

    A sequence is admitted when its prompt's pages are free (or held by free rows' cached prompts, which are dropped
    oldest first), with a page of growth left for each running sequence. Before a decode step every running
    sequence gets the pages of the positions the step may write; where the pool runs dry the newest sequence is
    preempted — its pages freed, itself queued first, to be prefilled again over its prompt and its tokens so far
    (what it computes then is what it computed before: the same positions' KV, bit for bit).

    While other sequences decode, prefill steps and their decode steps alternate, so a long prompt does not stall
    running streams for its whole prefill: where the prompt's split does not change its bits (``free_split``:
    prompts run as rows), a prefill step takes the positions whose work fits ``prefill_budget`` (keys read,
    :mod:`dmtd.engine.prefill_pacer`), else one chunk of ``prefill_chunk`` positions, boundaries at its multiples
    from position 0. With a prefix cache, an admitted
    prompt's leading whole chunks published before are read from their pages, shared, instead of computed
    (:mod:`dmtd.engine.prefix_cache`).
    """

    def __init__(self, dmtd: DMTDConfig, max_num_seqs: int, max_model_len: int,
                 max_prefill_tokens: int, align_phases: bool = False, prefill_chunk: int = 128,
                 prefix_caching: bool = True, pages: KVPages | None = None, cache_chunk: int | None = None,
                 long_prefill_tokens: int = 0) -> None:
        self.dmtd = dmtd
        # positions past num_tokens that one decode step may write: a check of τ − 1 drafts, or the draft before it
        self.lookahead = max(dmtd.tau_max, 1)
        # the prefix cache's unit: whole prefill chunks, or single pages where prompts run as rows (any split of a
        # prompt has the same bits there)
        self.kv = KVCacheManager(max_num_seqs, max_model_len, self.lookahead, cache_chunk or prefill_chunk,
                                 prefix_caching, pages)
        self.num_preempted = 0
        self._preempted: list[Sequence] = []  # since the engine last took them (take_preempted)
        # Phase alignment (prompt_end variants): heads of all rows fall on the same decode steps, so a
        # batched tail step reads only the decoding layers' weights. A row's first cycle after its
        # prompt, and the cycle after a confidence cut's head, are shortened to meet the shared clock.
        self.align_phases = align_phases and dmtd.phase_anchor == "prompt_end"
        self.num_decode_steps = 0
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max(max_prefill_tokens, prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.long_prefill_tokens = long_prefill_tokens  # longer prompts are paced beside decoding; 0: all are
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, their prompts partly prefilled
        self.running: list[Sequence] = []
        self._last_prefill = False
        # set by the engine before each step: whether a prompt may be split anywhere, and the keys a prefill step
        # may read while sequences decode (None: one chunk)
        self.free_split = False
        self.prefill_budget: float | None = None  # negative: no prefill step now (the pacer's credit is short)
        self.ride_budget: float | None = None  # keys prompt rows may add to a check pass
        self.last_prefill_keys = 0.0  # the work of the last prefill step (keys read), for the pacer
        self.last_prefill_paced = False
        self.num_rides = 0  # decode steps whose check pass carried prompt rows
        self.num_schedules = 0  # schedule() calls: a prompt's age in them orders prefill (_prefill_order)

    @property
    def pages(self) -> KVPages:
        return self.kv.pages

    @property
    def prefix(self) -> PrefixCache | None:
        return self.kv.prefix

    @property
    def num_free_kv_rows(self) -> int:
        return self.kv.num_free_rows

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens == 0:
            raise RequestError("prompt", "must not be empty")
        if seq.num_tokens >= self.max_model_len:
            raise CapacityError(
                "prompt", f"{seq.num_tokens} tokens do not fit the context of {self.max_model_len} "
                f"(at most {self.max_model_len - 1} prompt tokens)"
            )
        if not 1 <= seq.tau <= self.dmtd.tau_max:
            raise RequestError("tau", f"must be in 1..{self.dmtd.tau_max} (the variant's tau_max), "
                               f"got {seq.tau}")
        self.kv.check(seq)
        seq.queued_at = self.num_schedules
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Prompt chunks if any are due, else one decode step for every running sequence. A new prompt is
        prefilled at once; while a prompt is partly prefilled and others run, its chunks and decode steps
        alternate."""
        out = SchedulerOutput()
        self.num_schedules += 1
        if not self.running:
            self.num_decode_steps = 0  # idle: restart the shared clock, so a lone sequence keeps full cycles
        self.last_prefill_keys = 0.0
        paced = bool(self.free_split and self.running and self.prefill_budget is not None)
        # with verified cycles running, prompts ride along with a check pass (one comes every cycle) instead of
        # taking steps of their own
        exact = paced and any(s.params.exact for s in self.running)
        carrier = exact and any(s.params.exact and s.draft_done for s in self.running)
        self.last_prefill_paced = paced and not exact
        keys = (self.ride_budget if carrier else self.prefill_budget) or 0.0
        # a short prompt waits for no pacing credit (it still alternates with decode steps)
        short_due = paced and (any(map(self._short, self.prefilling))
                               or bool(self.waiting and self._short(self.waiting[0])))
        if (not (self.running and self._last_prefill and self.prefilling)
                and not (paced and keys < 0 and not short_due) and not (exact and not carrier)):
            C = self.prefill_chunk
            budget = C if self.running else self.max_prefill_tokens
            if self.free_split:  # every prompt that gets its pages now is admitted, then served in _prefill_order
                while self.waiting and self.kv.fits(self.waiting[0], len(self.running) + len(self.prefilling)):
                    if not self._admit(self.waiting.popleft(), out):
                        break
            queue = sorted(self.prefilling, key=self._prefill_order) if self.free_split else list(self.prefilling)
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
                    if not self._admit(seq, out):
                        break
                else:
                    break
                if self._computing_elsewhere(seq, claimed):
                    continue  # its next chunk is another prompt's: it waits, then reads it (kv.reuse)
                target = seq.resume_len or seq.num_tokens
                left = target - seq.num_prefilled
                whole = self.free_split and (not paced or self._short(seq))
                if (whole and stagger and out.prefill
                        and self.last_prefill_keys + prompt_cost(seq.num_prefilled, target) > STEP_KEYS):
                    break  # a step holds one prompt, or short ones up to STEP_KEYS: it answers none of them before
                    # its end, so the first ones start while the rest go on
                if paced and whole:  # a short prompt whole, now: the first whatever its cost, more while they fit
                    if out.prefill and prompt_cost(seq.num_prefilled, target) > keys:
                        break
                    end = target
                    keys -= prompt_cost(seq.num_prefilled, end)
                elif paced:  # what fits the step's budget, anywhere (at least one position)
                    if out.prefill and prompt_cost(seq.num_prefilled, seq.num_prefilled + 1) > keys:
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
                out.prefill.append(seq)
        if carrier and out.prefill:
            out.ride, out.prefill = out.prefill, []
            self.num_rides += 1
        self._last_prefill = bool(out.prefill)
        if not out.prefill:
            self._reserve_decode()
            out.decode = list(self.running)
            # a rider preempted for the decode's pages is queued again, its chunk not computed
            out.ride = [s for s in out.ride if s in self.prefilling]
        return out

    def _prefill_order(self, seq: Sequence) -> float:
        """Which admitted prompt a prefill step serves first, lowest first: the work left of it (keys read,
        :func:`prompt_cost`) over one plus its age in steps / ``AGE_STEPS`` — the shortest first (a prompt whose
        prefix is cached before one computed whole: the least mean time to first token), and none waits for ever
        behind later short ones."""
        self.kv.reuse(seq)  # chunks published since its admission count as done
        left = prompt_cost(seq.num_prefilled, seq.resume_len or seq.num_tokens)
        return left / (1.0 + (self.num_schedules - seq.queued_at) / AGE_STEPS)

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

    def _reserve_decode(self) -> None:
        """Every running sequence's pages for what this step may write, oldest first; the newest are preempted
        while the pool cannot give them."""
        for seq in sorted(self.running, key=lambda s: s.seq_no):
            while seq.status is SequenceStatus.RUNNING and not self.kv.grow(seq, seq.num_tokens + self.lookahead):
                self.preempt(max(self.running + self.prefilling, key=lambda s: s.seq_no))

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s cache row and pages and queue it first: it is prefilled again over its prompt and the tokens
        it has so far, and goes on from there (its emitted tokens stay emitted)."""
        (self.prefilling if seq in self.prefilling else self.running).remove(seq)
        self.kv.preempted(seq)
        seq.status = SequenceStatus.WAITING
        seq.clear_drafts()
        seq.num_preempted += 1
        self.num_preempted += 1
        self.waiting.appendleft(seq)
        self._preempted.append(seq)

    def take_preempted(self) -> list[Sequence]:
        """The sequences preempted since the last call (the engine drops their drafts' bookkeeping)."""
        out, self._preempted = self._preempted, []
        return out

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A cache row and KV pages for ``seq`` (its prompt's published chunks shared); False (back to the queue's
        head) if the pool cannot give them."""
        salt = f"{int(seq.params.exact)}:{seq.tau if self.dmtd.phase_anchor == 'absolute' else 0}"
        if not self.kv.admit(seq, salt):
            self.waiting.appendleft(seq)
            return False
        seq.status = SequenceStatus.RUNNING
        self.prefilling.append(seq)
        return True

    def reuse(self, seq: Sequence) -> None:
        """Right before ``seq``'s chunks run: chunks published since its admission are read, not computed."""
        self.kv.reuse(seq)

    def prefilled(self, seqs: list[Sequence]) -> list[Sequence]:
        """After a prefill step: the chunks are in the cache (published where whole); the sequences whose prompt
        is now complete run from the next step and are returned, in order."""
        done = []
        for seq in seqs:
            if self.kv.prefilled(seq):  # back where it was preempted: decode on
                seq.draft_done = seq.params.exact and seq.max_drafts(self.max_model_len) == 0
                self.prefilling.remove(seq)
                self.running.append(seq)
                self.running.sort(key=lambda s: s.kv_row)
            elif seq.num_prefilled == seq.num_tokens:
                self.prefilling.remove(seq)
                self.running.append(seq)
                done.append(seq)
        if done:
            self.running.sort(key=lambda s: s.kv_row)
        return done

    def admit_prefilled(self, seq: Sequence) -> bool:
        """Run a sequence whose prompt KV another sequence's prefill made (dmtd.engine.forks): a cache row now, or
        False."""
        if not self.kv.admit_prefilled(seq):
            return False
        self.kv.copied_prompt(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=lambda s: s.kv_row)
        return True

    def postprocess(self, out: SchedulerOutput, tokens: list[int], confidences: list[float],
                    eos_ids: set[int], advance_clock: bool = True) -> list[TokenEvent]:
        """Apply sampled tokens: advance phases, apply the confidence gate, close blocks, retire.

        The gate (ConfAdapt inside a cycle): a token sampled at a tail position with top-1 probability
        below the request's ``min_confidence`` is dropped, and the same position runs again at the next
        step as a head — the full stack predicts it instead. Its event carries ``token_id = -1`` and
        closes the block of the tokens accepted so far. A head's token is always kept, but one below the
        threshold makes the next position a head too (no tail is tried after an uncertain token). Every
        emitted token is then a head's or a confident tail's, and the realised schedule is still exactly
        a masked forward with those heads.
        """
        events = []
        # the decode step at which this batch's positions count as processed (prefill: just before the next)
        step = self.num_decode_steps - 1 if out.is_prefill else self.num_decode_steps
        for seq, tok, conf in zip(out.seqs, tokens, confidences):
            pos = seq.position
            if not out.is_prefill and pos != seq.next_head_pos and conf < seq.params.min_confidence:
                seq.next_head_pos = pos  # redo this position as a head; its tail KV is overwritten then
                seq.num_cycles_cut += 1
                ev = TokenEvent(seq.req_id, -1, pos, False, conf)
                if seq.block:
                    ev.block, ev.block_confidences = seq.block, seq.block_confidences
                    seq.block, seq.block_confidences = [], []
                events.append(ev)
                continue
            if out.is_prefill:
                is_head, seq.next_head_pos = self.dmtd.first_head_after_prompt(seq.num_tokens, seq.tau)
                self.kv.first_token(seq)
            else:
                is_head = pos == seq.next_head_pos
                if is_head:
                    self.kv.head(seq, pos)
                    seq.next_head_pos = self.dmtd.next_head(pos, seq.tau)
            if not (out.is_prefill or seq.params.exact):  # what a resume after a preemption replays
                (seq.tail_positions.discard if is_head else seq.tail_positions.add)(pos)
            if is_head and self.align_phases and len(self.running) > 1:  # alone, a row keeps full cycles
                seq.next_head_pos = pos + self._steps_to_aligned_head(step, seq.tau)
            seq.num_heads += is_head
            seq.num_tails += not is_head
            seq.token_ids.append(tok)
            seq.block.append(tok)
            seq.block_confidences.append(conf)
            new_pos = seq.position
            if conf < seq.params.min_confidence and new_pos < seq.next_head_pos:
                # an uncertain token (from a head: uncertain tails were dropped above) foretells an uncertain
                # next tail, whose dropped pass would be wasted: make the next position a head instead
                seq.next_head_pos = new_pos
                seq.num_cycles_cut += 1
            ev = TokenEvent(seq.req_id, tok, pos, is_head, conf)
            reason = self._stop_reason(seq, tok, eos_ids)
            if reason is not None:
                self.finish(seq, reason)
                ev.finished, ev.finish_reason = True, reason
            if reason is not None or new_pos == seq.next_head_pos or seq.params.exact:  # exact: blocks close at checks
                ev.block, ev.block_confidences = seq.block, seq.block_confidences
                seq.block, seq.block_confidences = [], []
            events.append(ev)
        if not out.is_prefill and advance_clock:
            self.num_decode_steps += 1
        return events

    def postprocess_drafts(self, seqs: list[Sequence], tokens: list[int], confidences: list[float],
                           eos_ids: set[int]) -> None:
        """Record one draft step of verified cycles; a row stops drafting at τ − 1 drafts, at a stop token,
        or at a draft whose confidence is below ``min_confidence`` (the gate decides only how much to draft).
        """
        for seq, tok, conf in zip(seqs, tokens, confidences):
            self.kv.drafted(seq)
            seq.add_drafts([tok], TAILS)
            if (seq.stops_at(tok, eos_ids) or conf < seq.params.min_confidence
                    or len(seq.drafts) >= seq.max_drafts(self.max_model_len)):
                seq.draft_done = True

    def postprocess_checked(self, seq: Sequence, tokens: list[int], num_accepted: int,
                            confidences: list[float], eos_ids: set[int]) -> list[TokenEvent]:
        """Apply one head's check (verified cycles): emit the accepted drafts and the verifier's token as
        one block, and roll back the rest — the rejected positions' KV is rewritten before it is read again.
        A verifier token below ``min_confidence`` skips the next cycle's drafting (its head comes next).
        """
        head = seq.position + num_accepted  # the position whose verifier logits gave the last token
        self.kv.checked(seq, head)
        seq.clear_drafts()  # the engine counts the cycle's drafts (dmtd.engine.draft_sources.DraftLedger)
        events = []
        for j, (tok, conf) in enumerate(zip(tokens, confidences)):
            is_head = j == len(tokens) - 1
            seq.num_heads += is_head
            seq.num_tails += not is_head
            seq.token_ids.append(tok)
            seq.block.append(tok)
            seq.block_confidences.append(conf)
            ev = TokenEvent(seq.req_id, tok, seq.position - 1, is_head, conf)
            reason = self._stop_reason(seq, tok, eos_ids)
            if reason is not None:
                self.finish(seq, reason)
                ev.finished, ev.finish_reason = True, reason
            if reason is not None or is_head:
                ev.block, ev.block_confidences = seq.block, seq.block_confidences
                seq.block, seq.block_confidences = [], []
                events.append(ev)
                break
            events.append(ev)
        # as in the gate: an uncertain verifier token foretells a rejected draft, so the next head comes at once
        uncertain = confidences[len(events) - 1] < seq.params.min_confidence
        seq.draft_done = seq.max_drafts(self.max_model_len) == 0 or uncertain
        return events

    @staticmethod
    def _steps_to_aligned_head(step: int, tau: int) -> int:
        """Steps from ``step`` to the next shared head step (those with ``(s + 1) % tau == 0``), in 1..tau."""
        k = -(step + 1) % tau
        return k or tau

    def _stop_reason(self, seq: Sequence, tok: int, eos_ids: set[int]) -> str | None:
        if seq.stops_at(tok, eos_ids):
            return "stop"
        if seq.num_generated >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Retire a sequence (finished, cancelled or failed) and free its cache row at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            (self.prefilling if seq in self.prefilling else self.running).remove(seq)
            self.kv.release(seq)  # its published chunks stay cached
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.error = reason, error
