"""Verified cycles (the exact profile): where a cycle's drafts come from — the tails' count, the pass-free sources
(prompt lookup, the phrase table; dmtd.engine.draft_sources), a grammar's forced tokens — and the postprocess of the
two pass kinds that make and check them (a draft step's tails, a head's check), with their accounting
(:class:`~dmtd.engine.draft_sources.DraftLedger`) and the costs the draft policy learns (``PassCosts``, the batch's
``DraftGate``). Each sequence's drafts live in its :class:`~dmtd.engine.draft_state.DraftState`, written here only.
The component is given what it uses — the model runner, the scheduler (its KV manager and block emission), the
logits shaper, the request records (generators, outputs) and the pass timer — never the engine."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from dmtd.engine import context_drafts
from dmtd.engine.acceptance import check_drafts, pick_drafts
from dmtd.engine.context_drafts import until_stop
from dmtd.engine.draft_gate import DraftGate
from dmtd.engine.draft_policy import (
    STEADY_CATCH_UP,
    TAIL_PASS_OVERHEAD,
    PassCosts,
    best_num_drafts,
    expected_tokens,
    worth_exploring,
)
from dmtd.engine.draft_sources import FORCED, TAILS, DraftLedger, PhraseTableDrafts, TailStandIn, context_sources
from dmtd.engine.outputs import StepOutput
from dmtd.engine.phrase_table import PhraseTable
from dmtd.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from dmtd.engine.config import EngineConfig
    from dmtd.engine.logits_process import LogitsShaper
    from dmtd.engine.pass_timer import PassTimer
    from dmtd.engine.request_processor import RequestProcessor
    from dmtd.engine.runner import ModelRunner
    from dmtd.engine.scheduler import Scheduler, StepPlan


class VerifiedCycles:
    """The exact profile's drafts: chosen per sequence, made by draft passes, checked at heads, counted by source."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, scheduler: Scheduler, shaper: LogitsShaper,
                 requests: RequestProcessor, timer: PassTimer, phrase_table: PhraseTable | None) -> None:
        self.cfg, self.runner, self.scheduler, self.kv = cfg, runner, scheduler, scheduler.kv
        self.shaper, self.requests, self.timed = shaper, requests, timer
        self.eos_ids = requests.eos_ids
        self.num_joined_checks = 0  # steps whose drafting exact sequences joined the check most made (align_checks)
        self._gate: DraftGate | None = None  # the batch gate, where this decode step is one of its windows
        self.pass_costs = PassCosts()  # what the draft policy learns of this machine
        self.draft_gate = DraftGate()  # whether drafts pay at all at the batch's size (measured, adaptive drafts)
        self.ledger = DraftLedger()  # drafts counted by source, per request and over every request so far
        self.phrase_drafts = PhraseTableDrafts(phrase_table) if phrase_table is not None else None
        self.sources = context_sources(self.phrase_drafts)  # the pass-free sources (context_drafts)
        self.forced_drafts = True  # a grammar's forced tokens are drafts of exact greedy requests (forced)
        self.tail_stand_in: TailStandIn | None = None  # greedy tails' tokens replaced (the bench's oracle drafter)

    def enable(self) -> None:
        """The first exact request: the verifier's KV, and a tail's prior cost. Before any draft is measured, a tail
        costs the share of weight bytes it reads, plus its pass's fixed costs: the flat prior (0.45) tied m = 1 with
        a plain step at the prior acceptance, so a fresh engine drafted only in its exploring cycles, whose catch-up
        passes are not measured (draft_policy)."""
        runner = self.runner
        if runner.verify_kv is not None:
            return
        runner.enable_exact()
        self.pass_costs.tail_prior = min(self.pass_costs.tail_prior, runner.draft_bytes_share() + TAIL_PASS_OVERHEAD)

    def after_prefill(self, seq: Sequence, confidence: float) -> None:
        """A prefilled exact request's first cycle: its draft count, and the sources that may draft it."""
        self.choose(seq)
        uncertain = confidence < seq.params.min_confidence
        seq.draft.done = seq.max_drafts(self.cfg.max_model_len) == 0 or uncertain
        if seq.status is SequenceStatus.RUNNING:
            self.forced(seq)
        if seq.status is SequenceStatus.RUNNING and not uncertain:
            self.from_context(seq)

    def resumed(self, seq: Sequence) -> None:
        """A preempted sequence is back where it was: its next cycle drafts from scratch."""
        seq.draft.done = seq.params.exact and seq.max_drafts(self.cfg.max_model_len) == 0

    def preempted(self, seqs: list[Sequence]) -> None:
        """Preempted sequences' drafts went with their pages."""
        for s in seqs:
            s.draft.clear()

    def assign(self, plan: StepPlan) -> None:
        """Which of a decode step's sequences run plain steps, draft or check (``plan.plain``, ``plan.drafting``,
        ``plan.checking``): the batch gate may switch every sequence between two cycles to its new window's mode, and
        with ``align_checks`` the drafting ones may join the check most make."""
        gate = self.draft_gate if self.cfg.adaptive_drafts and self.cfg.batch_gate else None
        if gate is not None and not any(s.params.exact and s.tau > 1 for s in plan.decode):
            # none could draft (τ = 1, or the unverified profile): the step is the same in either mode, and counted
            # as a window with drafts it read plain steps as drafts' goodput (a replica's τ = 1 traffic made drafts
            # "pay" at batch 16, and the exact default then ran windows of drafts at 0.5x)
            gate = None
        if gate is not None:
            gate.begin_step(len(plan.decode))
            if gate.switched:  # sequences between cycles take the new window's mode now, not at their next check
                self.switch(plan.decode)
        self._gate = gate
        plan.plain = [s for s in plan.decode if not s.params.exact]
        plan.drafting = [s for s in plan.decode if s.params.exact and not s.draft.done]
        plan.checking = [s for s in plan.decode if s.checks_next]
        if self._join_checks(plan.checking, plan.drafting):
            for s in plan.drafting:  # they join the check most make: their cycles go on in phase with them
                s.draft.done = True
            plan.checking, plan.drafting = [s for s in plan.decode if s.params.exact], []
            self.num_joined_checks += 1

    def _join_checks(self, checking: list[Sequence], drafting: list[Sequence]) -> bool:
        """With ``align_checks``: whether the sequences still drafting join this step's check — when the checking ones
        are at least as many as any group of drafting ones due to check on one later step (so always where they are
        half of the exact ones). Sequences spread evenly over the phases of a cycle (a fixed τ = 3 at batch 16 through
        the stack: 6, 5 and 5) never made half, and each step ran a draft pass and a check pass for ever."""
        if not (self.cfg.align_checks and checking and drafting):
            return False
        due = Counter(s.max_drafts(self.cfg.max_model_len) - len(s.draft.tokens) for s in drafting)
        return len(checking) >= max(due.values())

    def observe_step(self, plan: StepPlan, num_outputs: int, seconds: float, carried_prompts: bool) -> None:
        """The batch gate counts a decode step of its window (one carrying prompt rows measures neither mode)."""
        if self._gate is not None and not carried_prompts:
            self._gate.observe(len(plan.decode), num_outputs, seconds,
                               not any(s.draft.tokens and not s.draft.done for s in plan.decode))

    def draft(self, seqs: list[Sequence], since: float | None = None) -> list[StepOutput]:
        """A tail step of verified cycles: one draft per sequence, nothing emitted; a sequence stops drafting at its
        draft count, at a stop token, or at a draft whose confidence is below ``min_confidence`` (the gate decides
        only how much to draft). ``since``: when the step began, if it drafts only (its whole time is the draft's
        cost), else the pass alone is."""
        # positions each sequence's tail path catches up on in this pass: 1-2 while a request drafts every cycle, more
        # when it resumes after plain steps (one pass over all of them, a one-off that costs about two drafts)
        catch_up = max(s.draft_position - s.num_tail_cached + 1 for s in seqs)
        t0 = time.perf_counter() if since is None else since
        logits, dt = self.timed("draft", self.runner.draft, seqs)
        d = pick_drafts(logits, self.runner.pass_draft_ids, [s.params for s in seqs],
                        [self.requests.generator(s.req_id) for s in seqs])
        results = self.requests.fail([s for s, ok in zip(seqs, d.finite) if not ok])
        for i in (i for i, ok in enumerate(d.finite) if ok):
            s, tok = seqs[i], d.tokens[i]
            if self.tail_stand_in is not None and s.params.greedy:
                tok = self.tail_stand_in.replace(s, tok)
            s.draft.q.append(d.q[i])
            self.kv.drafted(s)
            s.draft.add([tok], TAILS)
            if (s.stops_at(tok, self.eos_ids) or d.confidences[i] < s.params.min_confidence
                    or len(s.draft.tokens) >= s.max_drafts(self.cfg.max_model_len)):
                s.draft.done = True
                self.extend(s)
        if catch_up <= STEADY_CATCH_UP:  # a resuming pass is no draft's steady cost: counted, it kept a request that
            # had stopped drafting from ever resuming
            self.pass_costs.observe_draft(len(seqs), time.perf_counter() - t0 if since is not None else dt,
                                          len(self.scheduler.running))
        return results

    def check(self, seqs: list[Sequence], since: float | None = None,
              prompts: list[Sequence] | None = None) -> list[StepOutput]:
        """A head of verified cycles: check every sequence's drafts and emit its block (``since``: as for draft).
        ``prompts``: prompt chunks that ride along in the same pass (:meth:`dmtd.engine.runner.ModelRunner.verify`)."""
        num_rows = sum(len(s.draft.tokens) + 1 for s in seqs)  # before the check clears them
        logits, dt = self.timed("verify", lambda s: self.runner.verify(s, prompts), seqs)
        R = logits.shape[1]
        results: list[StepOutput] = []
        for i, s in enumerate(seqs):
            rows, m = self.shaper.check_rows(logits[i, R - len(s.draft.tokens) - 1:], s)
            if m < len(s.draft.tokens):  # the grammar forbids a draft: the drafts end with it
                s.draft.trim(m)
            q, s.draft.q = s.draft.q[:m], []
            gen = self.requests.generator(s.req_id)
            c = check_drafts(rows, s.draft.tokens, q, self.runner.draft_ids, s.params, gen)
            self.shaper.record(s.req_id, s.params, rows, c.tokens)
            if not c.finite:
                results += self.requests.fail([s])
                continue
            generated, sources = s.num_generated, s.draft.sources
            self.choose(s)  # before the check is applied: it decides from the new target whether to draft
            s.draft.clear()  # counted below (self.ledger)
            events = self.scheduler.postprocess_checked(s, c.tokens, c.num_accepted, c.confidences, self.eos_ids)
            # as in the gate: an uncertain verifier token foretells a rejected draft, so the next head comes at once
            s.draft.done = (s.max_drafts(self.cfg.max_model_len) == 0
                            or c.confidences[len(events) - 1] < s.params.min_confidence)
            for j, ev in enumerate(events):
                o = self.requests.to_output(ev)
                results.append(o)
                if o.finished:
                    if j < len(events) - 1:  # a stop string ended the block early: it holds what was emitted
                        del s.token_ids[s.prompt_len + generated + j + 1:]
                        o.block, o.block_confidences = c.tokens[: j + 1], c.confidences[: j + 1]
                    break
            # drafts accepted past the end (a stop string, a stop token) were never emitted: not counted accepted
            last, accepted = results[-1], min(c.num_accepted, len(results[-1].block or []))
            last.num_drafted, last.num_accepted = m, accepted
            last.num_context_drafted, last.num_context_accepted = self.ledger.count(s, sources, accepted)
            if not last.finished:
                self.forced(s)
            if not last.finished and c.confidences[len(events) - 1] >= s.params.min_confidence:
                self.from_context(s)
        if not prompts:  # a check carrying prompt rows is no check's cost
            self.pass_costs.observe_check(len(seqs), R, time.perf_counter() - since if since is not None else dt,
                                          num_rows)
        return results

    def choose(self, seq: Sequence) -> None:
        """With ``adaptive_drafts``: the next cycle's draft count, from this request's acceptance so far and the
        measured pass costs (a plain base step when no count pays); every 8th cycle drafts one more, to keep
        measuring, where one more could pay at all (``worth_exploring``)."""
        if not self.cfg.adaptive_drafts:
            return
        if not self.draft_gate.allows():  # drafts do not pay at this batch size: a plain base step
            seq.draft.target = 0
            return
        most, batch, st = seq.draft_room(self.cfg.max_model_len), len(self.scheduler.running), seq.draft
        best = best_num_drafts(most, batch, self.pass_costs, st.accepted_by_pos, st.drafted_by_pos)
        explore = (seq.counts.num_heads + 1) % 8 == 0 and worth_exploring(best, most, batch, self.pass_costs,
                                                                          st.accepted_by_pos, st.drafted_by_pos)
        st.target = best + 1 if explore else best

    def switch(self, seqs: list[Sequence]) -> None:
        """The batch gate began a window of the other mode: the sequences between two cycles (no draft made yet)
        take it at once, where they had chosen their cycle under the last one at their check; one whose drafts are
        under way checks them first. Plain: its next step is a plain base step. Drafts: its policy chooses again (the
        uncertain-token rule of that check is not kept: one cycle)."""
        drafts = self.draft_gate.mode
        for s in seqs:
            if not s.params.exact or s.draft.tokens or s.status is not SequenceStatus.RUNNING:
                continue
            if not drafts:
                s.draft.target, s.draft.done = 0, True
            elif s.draft.done:
                self.choose(s)
                s.draft.done = s.max_drafts(self.cfg.max_model_len) == 0
                self.from_context(s)

    def from_context(self, seq: Sequence) -> None:
        """With ``context_drafts`` (and the adaptive policy, whose costs it weighs): make this cycle's drafts the
        tokens that followed the latest earlier occurrence of the context's last few tokens, where that has more
        expected tokens per cost than the tails' best count. Such drafts cost no tail pass, only the check's
        wider rows; their acceptance is counted apart (per request, per position, from the same prior)."""
        if not (self.cfg.context_drafts and self.cfg.adaptive_drafts and seq.params.greedy) or seq.draft.tokens \
                or not (self.draft_gate.allows() or self.pass_costs.use_row_costs):
            return
        # τ bounds a block whoever drafts it (τ = 1: the verifier alone; the controller's fill ratio k / τ)
        most = min(context_drafts.MAX_CONTEXT_DRAFTS, seq.draft_room(self.cfg.max_model_len))
        batch, costs, st = len(self.scheduler.running), self.pass_costs, seq.draft
        # with use_row_costs the batch gate's plain windows keep these drafts: they run no draft pass, so they split
        # no step, priced at the check's marginal cost of their rows (draft_policy; off: measured a loss at batch 16)
        tails = 0 if st.done or not self.draft_gate.allows() else seq.max_drafts(self.cfg.max_model_len)
        bar = expected_tokens(st.accepted_by_pos, st.drafted_by_pos, tails) / costs.cycle_cost(batch, tails)
        pick, source = context_drafts.choose(seq, self.ledger.seen, costs, batch, bar, most, self.eos_ids,
                                             self.sources)
        if pick:
            st.add(pick, source)
            st.done = True

    def forced(self, seq: Sequence) -> None:
        """Exact requests with a grammar: the tokens the grammar forces from here (a single legal way on) are this
        cycle's drafts, before any other source: no pass makes them, and the verifier's masked row accepts them
        unless it tokenises the same text otherwise (counted under ``FORCED``). A sampled request drafts
        them with certainty (q one-hot): the speculative rule then accepts one with the verifier's p."""
        p = seq.params
        if not (self.forced_drafts and p.exact and p.grammar is not None) or seq.draft.tokens:
            return
        forced = self.shaper.forced(seq.req_id)[: seq.draft_room(self.cfg.max_model_len)]
        if forced:
            seq.draft.add(forced, FORCED)
            seq.draft.done = True
            if not p.greedy:
                V, dev = self.runner.model.config.vocab_size, self.runner.device
                seq.draft.q = [
                    torch.zeros(V, device=dev).index_fill_(0, torch.tensor([t], device=dev), 1.0) for t in forced]

    def extend(self, seq: Sequence) -> None:
        """With a phrase table (and context drafts on): the tails' finished drafts go on with the table's
        continuation of them, as far as the check's wider rows pay for the tokens they are expected to add."""
        if self.phrase_drafts is None or not (self.cfg.context_drafts and self.cfg.adaptive_drafts
                                              and seq.params.greedy) or not seq.draft.tokens:
            return
        room = seq.draft_room(self.cfg.max_model_len) - len(seq.draft.tokens)
        last = seq.draft.tokens[-1]  # the tails stop drafting at a stop token: it can only be the last one
        if room <= 0 or seq.stops_at(last, self.eos_ids):
            return  # no room, or the tails drafted a stop token: nothing after it would be emitted
        more = self.phrase_drafts.extend(seq, room)
        if more is None:
            return
        source, cont = more
        pick = context_drafts.extension(seq, self.ledger.seen, self.pass_costs, len(self.scheduler.running),
                                        until_stop(seq, cont, self.eos_ids), source)
        if pick:
            seq.draft.add(pick, source)
