"""Continuous-batching scheduler (torch-free): admission, cache rows and their KV pages, chunked prefill, prefix reuse,
preemption, DMTD phases, blocks, retirement."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dmtd.engine.config import DMTDConfig
from dmtd.engine.kv_manager import CapacityError, KVCacheManager
from dmtd.engine.kv_pages import KVPages
from dmtd.engine.prefill_pacer import StepBudgets
from dmtd.engine.prefill_plan import PrefillPlanner
from dmtd.engine.prefix_cache import PrefixCache
from dmtd.engine.sequence import RequestError, Sequence, SequenceStatus

__all__ = ["CapacityError", "Scheduler", "StepPlan", "TokenEvent"]

@dataclass(slots=True, kw_only=True)
class StepPlan:
    """What one step runs, as :meth:`Scheduler.schedule` planned it: either prompt chunks (``prefill``: each sequence's
    positions ``num_prefilled .. prefill_end``, one sequence after the other) or one decode step of every running
    sequence (``decode``), with prompt chunks riding on its carrier pass (``ride``). The decode step's sequences by
    pass kind — ``plain`` ones run their heads and tails, ``drafting`` ones a draft pass, ``checking`` ones a check —
    are set by the verified-cycles component (:meth:`dmtd.engine.verified.VerifiedCycles.assign`)."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    ride: list[Sequence] = field(default_factory=list)
    plain: list[Sequence] = field(default_factory=list)
    drafting: list[Sequence] = field(default_factory=list)
    checking: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # their pages were taken back for this step's
    prefill_keys: float = 0.0  # the work of its prompt chunks (keys read, dmtd.engine.prefill_pacer)
    paced: bool = False  # its prefill step was paced beside decoding sequences

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefill or self.decode

    @property
    def heads(self) -> list[Sequence]:
        """The plain sequences at their heads (every layer group runs for them)."""
        return [s for s in self.plain if s.next_is_head]

    @property
    def tails(self) -> list[Sequence]:
        return [s for s in self.plain if not s.next_is_head]


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
    from position 0; which prompts, in what order: :mod:`dmtd.engine.prefill_plan`. With a prefix cache, an admitted
    prompt's leading whole chunks published before are read from their pages, shared, instead of computed
    (:mod:`dmtd.engine.prefix_cache`).
    """

    def __init__(self, dmtd: DMTDConfig, max_num_seqs: int, max_model_len: int,
                 max_prefill_tokens: int, *, align_phases: bool = False, prefill_chunk: int = 128,
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
        self._preempted: list[Sequence] = []  # while planning a step (StepPlan.preempted)
        self.on_resume: Callable[[Sequence], None] | None = None  # a preempted sequence decodes on (its next cycle)
        # Phase alignment (prompt_end variants): heads of all sequences fall on the same decode steps, so
        # a batched tail step reads only the decoding layers' weights. A sequence's first cycle after its
        # prompt, and the cycle after a confidence cut's head, are shortened to meet the shared clock.
        self.align_phases = align_phases and dmtd.phase_anchor == "prompt_end"
        self.num_decode_steps = 0
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, their prompts partly prefilled
        self.running: list[Sequence] = []
        # which prompts a prefill step computes (given these queues, never reassigned, and admission)
        self.planner = PrefillPlanner(kv=self.kv, waiting=self.waiting, prefilling=self.prefilling,
                                      running=self.running, admit=self._admit, prefill_chunk=prefill_chunk,
                                      max_prefill_tokens=max(max_prefill_tokens, prefill_chunk),
                                      long_prefill_tokens=long_prefill_tokens, align_phases=self.align_phases)
        self._last_prefill = False
        # the step's budgets (schedule's StepBudgets): whether a prompt may be split anywhere, and the keys a prefill
        # step may read while sequences decode (None: one chunk)
        self.free_split = False
        self.prefill_budget: float | None = None  # negative: no prefill step now (the pacer's credit is short)
        # keys prompt rows may add to a carrier step, by carrier (dmtd.engine.prefill_pacer.CARRIERS)
        self.ride_budgets: dict[str, float | None] = {}
        self.last_prefill_keys = 0.0  # the work of the last prefill step (keys read), for the pacer
        self.last_prefill_paced = False
        self.num_rides = 0  # decode steps that carried prompt rows (on a check pass or a head step)
        self.num_schedules = 0  # schedule() calls: a prompt's age in them orders prefill (PrefillPlanner.order)

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
    def num_prompts(self) -> int:
        """Sequences waiting or partly prefilled."""
        return len(self.waiting) + len(self.prefilling)

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
        self.planner.queued(seq, self.num_schedules)
        self.waiting.append(seq)

    def schedule(self, budgets: StepBudgets | None = None) -> StepPlan:
        """Prompt chunks if any are due, else one decode step for every running sequence. A new prompt is
        prefilled at once; while a prompt is partly prefilled and others run, its chunks and decode steps
        alternate. ``budgets``: what the pacer grants prompts this step (None: as the last step)."""
        if budgets is not None:
            self.free_split, self.prefill_budget, self.ride_budgets = budgets.free_split, budgets.prefill, budgets.ride
        out = StepPlan()
        self.num_schedules += 1
        if not self.running:
            self.num_decode_steps = 0  # idle: restart the shared clock, so a lone sequence keeps full cycles
        self.last_prefill_keys = 0.0
        paced = bool(self.free_split and self.running and self.prefill_budget is not None)
        # prompts ride along with a step the running sequences' cycles take anyway, once a cycle, instead of taking
        # steps of their own (the others waiting through them): with verified cycles running, a check pass; with only
        # the unverified profile's sequences running and waiting, a step where some reach their heads (every layer
        # group runs)
        kind = self._carrier_kind(paced)
        carrier = kind is not None and self._carries(kind)
        self.last_prefill_paced = paced and kind is None
        keys = (self.ride_budgets.get(kind) if kind is not None and carrier else self.prefill_budget) or 0.0
        if (not (self.running and self._last_prefill and self.prefilling)
                and not (paced and keys < 0 and not self.planner.short_due(paced)) and not (kind and not carrier)):
            self.last_prefill_keys = self.planner.plan(out.prefill, paced=paced, keys=keys, free_split=self.free_split,
                                                       num_schedules=self.num_schedules)
        if carrier and out.prefill:
            out.ride, out.prefill = out.prefill, []
            self.num_rides += 1
        self._last_prefill = bool(out.prefill)
        if not out.prefill:
            self._reserve_decode()
            out.decode = list(self.running)
            # a rider preempted for the decode's pages is queued again, its chunk not computed
            out.ride = [s for s in out.ride if s in self.prefilling]
        out.prefill_keys, out.paced = self.last_prefill_keys, self.last_prefill_paced
        out.preempted, self._preempted = self._preempted, []
        return out

    def _carrier_kind(self, paced: bool) -> str | None:
        """The step kind prompt rows ride on while these sequences run (:data:`~dmtd.engine.prefill_pacer.CARRIERS`),
        or None (prefill steps of their own): "check" with exact sequences running; "head" with only those of the
        unverified profile running and waiting (an exact prompt needs the verifying path, which only a check runs)."""
        if not paced:
            return None
        if any(s.params.exact for s in self.running):
            return "check"
        if any(s.params.exact for s in self.prefilling) or any(s.params.exact for s in self.waiting):
            return None
        return "head"

    def _carries(self, kind: str) -> bool:
        """Whether this step is a ``kind`` carrier: an exact sequence checks its drafts, or one is at its head."""
        if kind == "check":
            return any(s.checks_next for s in self.running)
        return any(s.next_is_head for s in self.running)

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
        seq.counts.num_preempted += 1
        self.num_preempted += 1
        self.waiting.appendleft(seq)
        self._preempted.append(seq)

    def _admit(self, seq: Sequence) -> bool:
        """A cache row and KV pages for ``seq`` (its prompt's published chunks shared); False (back to the queue's
        head) if the pool cannot give them."""
        # exact sequences of every variant share the trunk's and the verifier's KV (their tails' decoding-group KV of
        # a shared page is the publisher's: it shapes drafts only); an unverified sequence's output reads its own
        salt = f"{int(seq.params.exact)}:{seq.tau if self.dmtd.phase_anchor == 'absolute' else 0}"
        if not seq.params.exact and seq.variant:
            salt += f":{seq.variant}"
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
                if self.on_resume is not None:
                    self.on_resume(seq)
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

    def postprocess(self, out: StepPlan, tokens: list[int], confidences: list[float],
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
                seq.counts.num_cycles_cut += 1
                ev = TokenEvent(seq.req_id, -1, pos, False, conf)
                if seq.block.tokens:
                    ev.block, ev.block_confidences = seq.block.take()
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
            if is_head and self.align_phases and len(self.running) > 1:  # alone, a sequence keeps full cycles
                seq.next_head_pos = pos + self._steps_to_aligned_head(step, seq.tau)
            seq.counts.num_heads += is_head
            seq.token_ids.append(tok)
            seq.block.append(tok, conf)
            new_pos = seq.position
            if conf < seq.params.min_confidence and new_pos < seq.next_head_pos:
                # an uncertain token (from a head: uncertain tails were dropped above) foretells an uncertain
                # next tail, whose dropped pass would be wasted: make the next position a head instead
                seq.next_head_pos = new_pos
                seq.counts.num_cycles_cut += 1
            ev = TokenEvent(seq.req_id, tok, pos, is_head, conf)
            reason = self._stop_reason(seq, tok, eos_ids)
            if reason is not None:
                self.finish(seq, reason)
                ev.finished, ev.finish_reason = True, reason
            if reason is not None or new_pos == seq.next_head_pos or seq.params.exact:  # exact: blocks close at checks
                ev.block, ev.block_confidences = seq.block.take()
            events.append(ev)
        if not out.is_prefill and advance_clock:
            self.num_decode_steps += 1
        return events

    def postprocess_checked(self, seq: Sequence, tokens: list[int], num_accepted: int,
                            confidences: list[float], eos_ids: set[int]) -> list[TokenEvent]:
        """Apply one head's check (verified cycles): emit the accepted drafts and the verifier's token as
        one block, and roll back the rest — the rejected positions' KV is rewritten before it is read again.
        (The drafts themselves are the verified-cycles component's: dmtd.engine.verified.)
        """
        head = seq.position + num_accepted  # the position whose verifier logits gave the last token
        self.kv.checked(seq, head)
        events = []
        for j, (tok, conf) in enumerate(zip(tokens, confidences)):
            is_head = j == len(tokens) - 1
            seq.counts.num_heads += is_head
            seq.token_ids.append(tok)
            seq.block.append(tok, conf)
            ev = TokenEvent(seq.req_id, tok, seq.position - 1, is_head, conf)
            reason = self._stop_reason(seq, tok, eos_ids)
            if reason is not None:
                self.finish(seq, reason)
                ev.finished, ev.finish_reason = True, reason
            if reason is not None or is_head:
                ev.block, ev.block_confidences = seq.block.take()
                events.append(ev)
                break
            events.append(ev)
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
        self.planner.forget(seq)
        if seq.status is SequenceStatus.RUNNING:
            (self.prefilling if seq in self.prefilling else self.running).remove(seq)
            self.kv.release(seq)  # its published chunks stay cached
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.error = reason, error
