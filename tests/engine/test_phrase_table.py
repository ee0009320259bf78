"""The phrase table's drafts in the exact profile: a cycle may check the table's continuation of the context instead
of the tails' drafts, or after them; the output stays the verifier's."""

from __future__ import annotations

import pytest

from dmtd.engine.config import EngineConfig
from dmtd.engine.context_drafts import extension
from dmtd.engine.draft_policy import PassCosts
from dmtd.engine.draft_sources import LOOKUPS, TAILS, after_tails
from dmtd.engine.llm import LLMEngine
from dmtd.engine.phrase_table import LONG_HIGH, LONG_LOW, SHORT, SOURCES, PhraseTable
from dmtd.engine.sequence import SamplingParams, Sequence
from dmtd.train.corpus import Record
from dmtd.train.phrase_table import build
from tests.conftest import tiny_engine
from tests.engine.test_exact import DMTD, base_model, prompts_of

VOCAB = 97
COSTS = dict(checks={(b, r): 1.0 + 0.05 * r for b in range(1, 6) for r in range(1, 8)},
             drafts={b: 0.3 for b in range(1, 6)}, decay=1.0)


def table_of(answers: list[list[int]], min_share: float = 0.5) -> PhraseTable:
    return build([Record(i, i, "train", 0.0, 0, [], a, "length") for i, a in enumerate(answers)], VOCAB, 1,
                 min_share)


def test_the_continuation_chains_lookups_backs_off_to_two_tokens_and_names_the_first_tokens_source():
    t = PhraseTable(VOCAB, {})
    t.entries[t.key([1, 2, 3])] = (4, 90)
    t.entries[t.key([2, 3, 4])] = (5, 60)
    t.entries[t.key([3, 4, 5])] = (6, 100)
    assert t.continuation([9, 1, 2, 3], 5) == ([4, 5, 6], LONG_HIGH)  # chained: each context ends in the last
    assert t.continuation([1, 2, 3], 2) == ([4, 5], LONG_HIGH)
    assert t.continuation([7, 2, 3, 4], 3) == ([5, 6], LONG_LOW)  # 60 %: the lower band
    assert t.continuation([2, 3], 3) == ([], "") and t.continuation([1, 2, 3], 0) == ([], "")
    assert t.continuation([3, 2, 1], 3) == ([], "")
    t.short[t.key([2, 1])] = (7, 55)  # 3 2 1 is not there, 2 1 is
    t.short[t.key([5, 6])] = (8, 70)
    assert t.continuation([3, 2, 1], 3) == ([7], SHORT)
    assert t.continuation([2, 1], 3) == ([7], SHORT)  # two tokens of context are enough for the short table
    assert t.continuation([1, 2, 3], 4) == ([4, 5, 6, 8], LONG_HIGH)  # 4 5 6: backs off to 5 6 → 8
    assert len(t) == 5
    ext = [after_tails(s) for s in SOURCES]
    assert len(set(ext)) == len(SOURCES) and not set(ext) & set(SOURCES) and not set(ext) & set(LOOKUPS.values())


def _engine(base, table: PhraseTable | None, phrase: bool = True) -> LLMEngine:
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=4, max_model_len=256, adaptive_drafts=True,
                                                   draft_quant="none", phrase_drafts=phrase),
                    default_tau=1, eos_token_ids=[], phrase_table=table)
    eng.cycles.pass_costs = PassCosts(**COSTS)
    return eng


@pytest.mark.parametrize("think_scale", [0.0, 1.0])
def test_table_drafts_keep_the_output_the_verifiers_and_are_counted_apart(think_scale):
    base = base_model(3, think_scale)
    prompts = prompts_of([5, 9, 13, 7], 4)
    params = SamplingParams(max_new_tokens=40, tau=1)
    ref = tiny_engine(base, DMTD).generate(prompts, params)
    right = table_of([p[-3:] + r.token_ids for p, r in zip(prompts, ref)])  # the verifier's own answers
    never = min(set(range(VOCAB)) - {t for r in ref for t in r.token_ids})  # no answer has it
    wrong = PhraseTable(VOCAB, {k: (never, p) for k, (_, p) in right.entries.items()},
                        {k: (never, p) for k, (_, p) in right.short.items()})
    exact = SamplingParams(max_new_tokens=40, tau=3, exact=True)
    for table, good in ((right, True), (wrong, False)):
        eng = _engine(base, table)
        got = eng.generate(prompts, exact)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
        for r in got:
            assert sum(map(len, r.blocks)) == len(r.token_ids) and max(map(len, r.blocks)) <= 3
            assert 0 <= r.num_context_accepted <= r.num_context_drafted <= r.num_drafted
            assert sum(r.accepted_by_pos) == r.num_accepted - r.num_context_accepted  # by position: the tails'
            assert sum(r.drafted_by_pos) == r.num_drafted - r.num_context_drafted
        table_counts = [v for k, v in eng.cycles.ledger.seen.items() if k in SOURCES]  # the engine's, by source
        assert sum(d[0] for d, _ in table_counts) > 0  # the table drafted
        # a table of the answers is right, one of a token they lack never (prompt lookups count apart, by n)
        assert (sum(a[0] for _, a in table_counts) > 0) is good
    off = _engine(base, right, phrase=False)
    assert [r.token_ids for r in off.generate(prompts, exact)] == [r.token_ids for r in ref]
    assert off.cycles.ledger.seen and set(off.cycles.ledger.seen) <= set(LOOKUPS.values())  # prompt lookups alone


def test_the_table_goes_on_from_the_tails_drafts_where_it_knows_their_continuation():
    """A table of every third position of the answers: where it has no continuation of the context, the tails draft
    and the table may go on from their drafts; those tokens count apart (after_tails), the output is τ = 1's."""
    base = base_model(3, 0.0)  # tails as good as the full stack: their drafts are the answers' tokens
    prompts = prompts_of([5, 9, 13, 7], 4)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=40, tau=1))
    table = PhraseTable(VOCAB, {})
    for p, r in zip(prompts, ref):
        ids = p[-3:] + r.token_ids
        for i in range(3, len(ids), 3):
            table.entries[table.key(ids[i - 3: i])] = (ids[i], 100)
    eng = _engine(base, table)
    got = eng.generate(prompts, SamplingParams(max_new_tokens=40, tau=4, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    drafted, accepted = eng.cycles.ledger.seen[after_tails(LONG_HIGH)]
    assert drafted[0] > 0 and 0 < accepted[0] <= drafted[0]
    for r in got:
        assert max(map(len, r.blocks)) <= 4 and 0 <= r.num_context_accepted <= r.num_context_drafted
        assert sum(r.accepted_by_pos) == r.num_accepted - r.num_context_accepted
        assert sum(r.drafted_by_pos) == r.num_drafted - r.num_context_drafted


def test_nothing_goes_on_past_a_stop_token_and_what_was_not_emitted_is_not_counted_accepted():
    """A table that knows what follows a request's stop token: no table token goes after a tail draft that is the
    stop token (it would be accepted and never emitted), and a request's counts hold only what it streamed."""
    base = base_model(3, 0.0)
    prompts = prompts_of([5, 9, 13, 7], 4)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=40, tau=1))
    for stop_pos in range(2, 14):
        for p, r in zip(prompts, ref):
            stop = r.token_ids[stop_pos]
            ids = p[-3:] + r.token_ids
            table = PhraseTable(VOCAB, {})
            for i in range(3, len(ids)):
                if i % 3 == 0 or ids[i - 1] == stop:
                    table.entries[table.key(ids[i - 3: i])] = (ids[i], 100)
            got = _engine(base, table).generate([p], SamplingParams(max_new_tokens=40, tau=4, exact=True,
                                                                    stop_token_ids=[stop]))[0]
            want = tiny_engine(base, DMTD).generate([p], SamplingParams(max_new_tokens=40, tau=1,
                                                                        stop_token_ids=[stop]))[0]
            assert got.token_ids == want.token_ids and got.finish_reason == "stop"
            assert got.num_accepted <= len(got.token_ids) - len(got.blocks) + 1  # the last block may lack a head
            assert sum(got.accepted_by_pos) == got.num_accepted - got.num_context_accepted
            assert 0 <= got.num_context_accepted <= got.num_context_drafted


def test_a_table_for_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="phrase_table: made for a vocabulary of 50"):
        _engine(base_model(3, 1.0), PhraseTable(50, {}))


def _seq_with_drafts(tail_acc: tuple[int, int]) -> Sequence:
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(max_new_tokens=20, exact=True), tau=4)
    seq.draft.add([7], TAILS)
    seq.draft.done = True
    seq.draft.drafted_by_pos, seq.draft.accepted_by_pos = [tail_acc[1]], [tail_acc[0]]
    return seq


@pytest.mark.parametrize("tails,ext,expect", [((90, 100), (45, 50), 2), ((90, 100), (0, 50), 0),
                                              ((0, 100), (45, 50), 0), ((90, 100), None, 2)])
def test_the_table_goes_on_from_the_tails_only_where_it_pays(tails, ext, expect):
    """After the tails' drafts, the table's tokens pay where the tails' are likely right (the table's count only
    then) and the table's own were right after them so far (a fresh engine: the prior, 0.5 a position)."""
    seq = _seq_with_drafts(tails)
    source = after_tails(LONG_HIGH)
    seen = {} if ext is None else {source: ([ext[1], ext[0]], [ext[0], int(ext[0] * 0.9)])}
    costs = PassCosts(checks={(1, r): 1.0 + 0.1 * r for r in range(1, 8)}, drafts={1: 0.3}, decay=1.0)
    assert len(extension(seq, seen, costs, 1, [8, 9], source)) == expect
