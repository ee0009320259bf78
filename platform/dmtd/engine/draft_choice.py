"""How a verified cycle gets its drafts — the tails' count, prompt lookup, the phrase table's continuation, a
grammar's forced tokens — and how drafts accepted past a block's end are taken back. A part of
:class:`dmtd.engine.llm.LLMEngine`, kept apart so the facade reads as schedule → run → postprocess."""

from __future__ import annotations

import torch

from dmtd.engine import context_drafts
from dmtd.engine.config import EngineConfig
from dmtd.engine.context_drafts import until_stop
from dmtd.engine.draft_gate import DraftGate
from dmtd.engine.draft_policy import PassCosts, best_num_drafts, expected_tokens, worth_exploring
from dmtd.engine.logits_process import FORCED_SOURCE, LogitsShaper
from dmtd.engine.phrase_table import N, PhraseTable, extension_source
from dmtd.engine.runner import ModelRunner
from dmtd.engine.scheduler import Scheduler
from dmtd.engine.sequence import Sequence


class DraftChoice:
    """The draft sources' choices for one sequence at a time (mixed into the engine, whose state they read)."""

    cfg: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner
    pass_costs: PassCosts
    draft_gate: DraftGate
    context_by_pos: context_drafts.Counts
    eos_ids: set[int]
    phrase_table: PhraseTable | None
    shaper: LogitsShaper
    forced_drafts: bool
    _draft_q: dict[str, list[torch.Tensor | None]]

    def _choose_drafts(self, seq: Sequence) -> None:
        """With ``adaptive_drafts``: the next cycle's draft count, from this request's acceptance so far and the
        measured pass costs (a plain base step when no count pays); every 8th cycle drafts one more, to keep
        measuring, where one more could pay at all (``worth_exploring``)."""
        if not self.cfg.adaptive_drafts:
            return
        if not self.draft_gate.allows():  # drafts do not pay at this batch size: a plain base step
            seq.draft_target = 0
            return
        most, batch = seq.draft_room(self.cfg.max_model_len), len(self.scheduler.running)
        best = best_num_drafts(most, batch, self.pass_costs, seq.accepted_by_pos, seq.drafted_by_pos)
        explore = (seq.num_heads + 1) % 8 == 0 and worth_exploring(best, most, batch, self.pass_costs,
                                                                   seq.accepted_by_pos, seq.drafted_by_pos)
        seq.draft_target = best + 1 if explore else best

    def _context_drafts(self, seq: Sequence) -> None:
        """With ``context_drafts`` (and the adaptive policy, whose costs it weighs): make this cycle's drafts the
        tokens that followed the latest earlier occurrence of the context's last few tokens, where that has more
        expected tokens per cost than the tails' best count. Such drafts cost no tail pass, only the check's
        wider rows; their acceptance is counted apart (per request, per position, from the same prior)."""
        if not (self.cfg.context_drafts and self.cfg.adaptive_drafts and seq.params.greedy) or seq.drafts \
                or not self.draft_gate.allows():
            return
        # τ bounds a block whoever drafts it (τ = 1: the verifier alone; the controller's fill ratio k / τ)
        most = min(context_drafts.MAX_CONTEXT_DRAFTS, seq.draft_room(self.cfg.max_model_len))
        batch, costs = len(self.scheduler.running), self.pass_costs
        tails = 0 if seq.draft_done else seq.max_drafts(self.cfg.max_model_len)
        bar = expected_tokens(seq.accepted_by_pos, seq.drafted_by_pos, tails) / costs.cycle_cost(batch, tails)
        pick, n = context_drafts.choose(seq, self.context_by_pos, costs, batch, bar, most, self.eos_ids,
                                        self.phrase_table)
        if pick:
            seq.drafts, seq.draft_done, seq.context_ngram = pick, True, n

    def _forced_drafts(self, seq: Sequence) -> None:
        """Exact requests with a grammar: the tokens the grammar forces from here (a single legal way on) are this
        cycle's drafts, before any other source: no pass makes them, and the verifier's masked row accepts them
        unless it tokenises the same text otherwise (counted under ``FORCED_SOURCE``). A sampled request drafts
        them with certainty (q one-hot): the speculative rule then accepts one with the verifier's p."""
        p = seq.params
        if not (self.forced_drafts and p.exact and p.grammar is not None) or seq.drafts:
            return
        forced = self.shaper.forced(seq.req_id)[: seq.draft_room(self.cfg.max_model_len)]
        if forced:
            seq.drafts, seq.draft_done, seq.context_ngram = forced, True, FORCED_SOURCE
            if not p.greedy:
                V = self.runner.model.config.vocab_size
                self._draft_q[seq.req_id] = [torch.zeros(V, device=self.runner.device).index_fill_(0, torch.tensor(
                    [t], device=self.runner.device), 1.0) for t in forced]

    def _extend_drafts(self, seq: Sequence) -> None:
        """With a phrase table (and context drafts on): the tails' finished drafts go on with the table's
        continuation of them, as far as the check's wider rows pay for the tokens they are expected to add."""
        if self.phrase_table is None or not (self.cfg.context_drafts and self.cfg.adaptive_drafts
                                             and seq.params.greedy) or not seq.drafts:
            return
        room = seq.draft_room(self.cfg.max_model_len) - len(seq.drafts)
        last = seq.drafts[-1]  # the tails stop drafting at a stop token: it can only be the last one
        if room <= 0 or seq.stops_at(last, self.eos_ids):
            return  # no room, or the tails drafted a stop token: nothing after it would be emitted
        cont, band = self.phrase_table.continuation(seq.token_ids[-N:] + seq.drafts, room)
        source = extension_source(band)
        pick = context_drafts.extension(seq, self.context_by_pos, self.pass_costs, len(self.scheduler.running),
                                        until_stop(seq, cont, self.eos_ids), source)
        if pick:
            seq.drafts += pick
            seq.num_extended, seq.extension_source = len(pick), source

    @staticmethod
    def _unaccept(seq: Sequence, num_accepted: int, num_emitted: int, context: int, tails: int,
                  ext_source: int, extended: int) -> None:
        """Accepted drafts past a stop string were never emitted: count only those that were (``tails``: the
        cycle's tail drafts, the ``extended`` phrase-table drafts after them counted under ``ext_source``, and
        counted as drafted only where every tail draft was accepted: not so where the block ended before)."""
        if extended and num_accepted >= tails > 0 and num_emitted < tails:
            drafted = seq.context_by_pos[ext_source][0]
            for j in range(extended):
                drafted[j] -= 1
        for j in range(num_emitted, num_accepted):
            seq.num_accepted -= 1
            if context:
                seq.context_by_pos[context][1][j] -= 1
                seq.num_context_accepted -= 1
            elif j >= tails:
                seq.context_by_pos[ext_source][1][j - tails] -= 1
                seq.num_context_accepted -= 1
            else:
                seq.accepted_by_pos[j] -= 1
