"""Verified cycles (the exact profile): where a cycle's drafts come from — the tails' count, the pass-free sources
(prompt lookup, the phrase table; dmtd.engine.draft_sources), a grammar's forced tokens — and the postprocess of the
two pass kinds that make and check them (a draft step's tails, a head's check), with their accounting
(:class:`~dmtd.engine.draft_sources.DraftLedger`) and the costs the draft policy learns (``PassCosts``, the batch's
``DraftGate``). The engine (dmtd.engine.llm) runs the passes and owns the requests; this object decides and counts."""

from __future__ import annotations

import time
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
from dmtd.engine.draft_sources import FORCED, DraftLedger, PhraseTableDrafts, context_sources
from dmtd.engine.outputs import StepOutput
from dmtd.engine.phrase_table import PhraseTable
from dmtd.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from dmtd.engine.llm import LLMEngine


class VerifiedCycles:
    """The exact profile's drafts: chosen per sequence, made by draft passes, checked at heads, counted by source."""

    def __init__(self, engine: LLMEngine, phrase_table: PhraseTable | None) -> None:
        self.engine, self.cfg = engine, engine.cfg
        self.pass_costs = PassCosts()  # what the draft policy learns of this machine
        self.draft_gate = DraftGate()  # whether drafts pay at all at the batch's size (measured, adaptive drafts)
        self.ledger = DraftLedger()  # drafts counted by source, per request and over every request so far
        self.phrase_drafts = PhraseTableDrafts(phrase_table) if phrase_table is not None else None
        self.sources = context_sources(self.phrase_drafts)  # the pass-free sources (context_drafts)
        self.forced_drafts = True  # a grammar's forced tokens are drafts of exact greedy requests (forced)

    def enable(self) -> None:
        """The first exact request: the verifier's KV, and a tail's prior cost. Before any draft is measured, a tail
        costs the share of weight bytes it reads, plus its pass's fixed costs: the flat prior (0.45) tied m = 1 with
        a plain step at the prior acceptance, so a fresh engine drafted only in its exploring cycles, whose catch-up
        passes are not measured (draft_policy)."""
        runner = self.engine.runner
        if runner.verify_kv is not None:
            return
        runner.enable_exact()
        self.pass_costs.tail_prior = min(self.pass_costs.tail_prior, runner.draft_bytes_share() + TAIL_PASS_OVERHEAD)

    def after_prefill(self, seq: Sequence, confidence: float) -> None:
        """A prefilled exact request's first cycle: its draft count, and the sources that may draft it."""
        self.choose(seq)
        uncertain = confidence < seq.params.min_confidence
        seq.draft_done = seq.max_drafts(self.cfg.max_model_len) == 0 or uncertain
        if seq.status is SequenceStatus.RUNNING:
            self.forced(seq)
        if seq.status is SequenceStatus.RUNNING and not uncertain:
            self.from_context(seq)

    def draft(self, seqs: list[Sequence], since: float | None = None) -> list[StepOutput]:
        """A tail step of verified cycles: one draft per row, nothing emitted. ``since``: when the step began, if
        it drafts only (its whole time is the draft's cost), else the pass alone is."""
        e = self.engine
        # positions each row's tail path catches up on in this pass: 1-2 while a request drafts every cycle, more
        # when it resumes after plain steps (one pass over all of them, a one-off that costs about two drafts)
        catch_up = max(s.draft_position - s.num_tail_cached + 1 for s in seqs)
        t0 = time.perf_counter() if since is None else since
        logits, dt = e.timed("draft", e.runner.draft, seqs)
        d = pick_drafts(logits, e.runner.pass_draft_ids, [s.params for s in seqs],
                        [e.requests[s.req_id].gen for s in seqs])
        results = e.fail([s for s, ok in zip(seqs, d.finite) if not ok])
        keep = [i for i, ok in enumerate(d.finite) if ok]
        for i in keep:
            e.requests[seqs[i].req_id].draft_q.append(d.q[i])
        e.scheduler.postprocess_drafts([seqs[i] for i in keep], [d.tokens[i] for i in keep],
                                          [d.confidences[i] for i in keep], e.eos_ids)
        for i in keep:
            if seqs[i].draft_done:
                self.extend(seqs[i])
        if catch_up <= STEADY_CATCH_UP:  # a resuming pass is no draft's steady cost: counted, it kept a request that
            # had stopped drafting from ever resuming
            self.pass_costs.observe_draft(len(seqs), time.perf_counter() - t0 if since is not None else dt,
                                          len(e.scheduler.running))
        return results

    def check(self, seqs: list[Sequence], since: float | None = None,
              prompts: list[Sequence] | None = None) -> list[StepOutput]:
        """A head of verified cycles: check every row's drafts and emit its block (``since``: as for draft).
        ``prompts``: prompt chunks that ride along in the same pass (:meth:`dmtd.engine.runner.ModelRunner.verify`)."""
        e = self.engine
        logits, dt = e.timed("verify", lambda s: e.runner.verify(s, prompts), seqs)
        R = logits.shape[1]
        results: list[StepOutput] = []
        for i, s in enumerate(seqs):
            rows, m = e.shaper.check_rows(logits[i, R - len(s.drafts) - 1:], s)
            if m < len(s.drafts):  # the grammar forbids a draft: the drafts end with it
                s.trim_drafts(m)
            req = e.requests[s.req_id]
            q, req.draft_q = req.draft_q[:m], []
            c = check_drafts(rows, s.drafts, q, e.runner.draft_ids, s.params, req.gen)
            e.shaper.record(s.req_id, s.params, rows, c.tokens)
            if not c.finite:
                results += e.fail([s])
                continue
            generated, sources = s.num_generated, s.draft_sources
            self.choose(s)  # before the check is applied: it decides from the new target whether to draft
            events = e.scheduler.postprocess_checked(s, c.tokens, c.num_accepted, c.confidences, e.eos_ids)
            for j, ev in enumerate(events):
                o = e.to_output(ev)
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
            self.pass_costs.observe_check(len(seqs), R, time.perf_counter() - since if since is not None else dt)
        return results

    def choose(self, seq: Sequence) -> None:
        """With ``adaptive_drafts``: the next cycle's draft count, from this request's acceptance so far and the
        measured pass costs (a plain base step when no count pays); every 8th cycle drafts one more, to keep
        measuring, where one more could pay at all (``worth_exploring``)."""
        if not self.cfg.adaptive_drafts:
            return
        if not self.draft_gate.allows():  # drafts do not pay at this batch size: a plain base step
            seq.draft_target = 0
            return
        most, batch = seq.draft_room(self.cfg.max_model_len), len(self.engine.scheduler.running)
        best = best_num_drafts(most, batch, self.pass_costs, seq.accepted_by_pos, seq.drafted_by_pos)
        explore = (seq.num_heads + 1) % 8 == 0 and worth_exploring(best, most, batch, self.pass_costs,
                                                                   seq.accepted_by_pos, seq.drafted_by_pos)
        seq.draft_target = best + 1 if explore else best

    def switch(self, seqs: list[Sequence]) -> None:
        """The batch gate began a window of the other mode: the rows between two cycles (no draft made yet) take it
        at once, where they had chosen their cycle under the last one at their check; a row whose drafts are under
        way checks them first. Plain: the row's next step is a plain base step. Drafts: its policy chooses again (the
        uncertain-token rule of that check is not kept: one cycle)."""
        drafts = self.draft_gate.mode
        for s in seqs:
            if not s.params.exact or s.drafts or s.status is not SequenceStatus.RUNNING:
                continue
            if not drafts:
                s.draft_target, s.draft_done = 0, True
            elif s.draft_done:
                self.choose(s)
                s.draft_done = s.max_drafts(self.cfg.max_model_len) == 0
                self.from_context(s)

    def from_context(self, seq: Sequence) -> None:
        """With ``context_drafts`` (and the adaptive policy, whose costs it weighs): make this cycle's drafts the
        tokens that followed the latest earlier occurrence of the context's last few tokens, where that has more
        expected tokens per cost than the tails' best count. Such drafts cost no tail pass, only the check's
        wider rows; their acceptance is counted apart (per request, per position, from the same prior)."""
        if not (self.cfg.context_drafts and self.cfg.adaptive_drafts and seq.params.greedy) or seq.drafts \
                or not self.draft_gate.allows():
            return
        # τ bounds a block whoever drafts it (τ = 1: the verifier alone; the controller's fill ratio k / τ)
        most = min(context_drafts.MAX_CONTEXT_DRAFTS, seq.draft_room(self.cfg.max_model_len))
        batch, costs = len(self.engine.scheduler.running), self.pass_costs
        tails = 0 if seq.draft_done else seq.max_drafts(self.cfg.max_model_len)
        bar = expected_tokens(seq.accepted_by_pos, seq.drafted_by_pos, tails) / costs.cycle_cost(batch, tails)
        pick, source = context_drafts.choose(seq, self.ledger.seen, costs, batch, bar, most, self.engine.eos_ids,
                                             self.sources)
        if pick:
            seq.add_drafts(pick, source)
            seq.draft_done = True

    def forced(self, seq: Sequence) -> None:
        """Exact requests with a grammar: the tokens the grammar forces from here (a single legal way on) are this
        cycle's drafts, before any other source: no pass makes them, and the verifier's masked row accepts them
        unless it tokenises the same text otherwise (counted under ``FORCED``). A sampled request drafts
        them with certainty (q one-hot): the speculative rule then accepts one with the verifier's p."""
        p = seq.params
        if not (self.forced_drafts and p.exact and p.grammar is not None) or seq.drafts:
            return
        forced = self.engine.shaper.forced(seq.req_id)[: seq.draft_room(self.cfg.max_model_len)]
        if forced:
            seq.add_drafts(forced, FORCED)
            seq.draft_done = True
            if not p.greedy:
                V, dev = self.engine.runner.model.config.vocab_size, self.engine.runner.device
                self.engine.requests[seq.req_id].draft_q = [
                    torch.zeros(V, device=dev).index_fill_(0, torch.tensor([t], device=dev), 1.0) for t in forced]

    def extend(self, seq: Sequence) -> None:
        """With a phrase table (and context drafts on): the tails' finished drafts go on with the table's
        continuation of them, as far as the check's wider rows pay for the tokens they are expected to add."""
        if self.phrase_drafts is None or not (self.cfg.context_drafts and self.cfg.adaptive_drafts
                                              and seq.params.greedy) or not seq.drafts:
            return
        room = seq.draft_room(self.cfg.max_model_len) - len(seq.drafts)
        last = seq.drafts[-1]  # the tails stop drafting at a stop token: it can only be the last one
        if room <= 0 or seq.stops_at(last, self.engine.eos_ids):
            return  # no room, or the tails drafted a stop token: nothing after it would be emitted
        more = self.phrase_drafts.extend(seq, room)
        if more is None:
            return
        source, cont = more
        pick = context_drafts.extension(seq, self.ledger.seen, self.pass_costs, len(self.engine.scheduler.running),
                                        until_stop(seq, cont, self.engine.eos_ids), source)
        if pick:
            seq.add_drafts(pick, source)
