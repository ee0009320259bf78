"""Draft sources by name and the ledger that counts a checked cycle once (dmtd.engine.draft_sources)."""

from __future__ import annotations

from dmtd.engine.draft_sources import LOOKUPS, TAILS, DraftLedger, PhraseTableDrafts, PromptLookup, after_tails, parts
from dmtd.engine.phrase_table import LONG_HIGH, PhraseTable
from dmtd.engine.sequence import SamplingParams, Sequence


def _seq(ids: list[int]) -> Sequence:
    return Sequence("r", ids, SamplingParams(max_new_tokens=20, exact=True), tau=4)


def test_a_cycles_drafts_split_into_runs_by_source():
    assert parts([]) == []
    assert parts([TAILS, TAILS, "x+tails"]) == [(TAILS, 0, 2), ("x+tails", 2, 1)]
    assert parts(["lookup3"] * 3) == [("lookup3", 0, 3)]


def test_prompt_lookup_proposes_its_longest_match_under_its_n():
    seq = _seq([5, 6, 7, 8, 9, 5, 6, 7])  # 5 6 7 occurred before: 8 9 followed it
    assert PromptLookup().propose(seq, 2) == (LOOKUPS[3], [8, 9])
    seq = _seq([1, 6, 7, 8, 9, 5, 2, 6, 7])  # 2 6 7 is new, 6 7 is not: the 2-token match
    assert PromptLookup().propose(seq, 3) == (LOOKUPS[2], [8, 9, 5])
    assert PromptLookup().propose(_seq([1, 2, 3, 4]), 3) is None


def test_the_phrase_table_names_its_band_and_goes_on_after_the_tails():
    table = PhraseTable(100, {})
    table.entries[table.key([1, 2, 3])] = (4, 95)
    table.entries[table.key([2, 3, 4])] = (5, 95)
    src = PhraseTableDrafts(table)
    assert src.propose(_seq([1, 2, 3]), 2) == (LONG_HIGH, [4, 5])
    seq = _seq([9, 1, 2])
    seq.draft.add([3], TAILS)  # the tails drafted 3: the table goes on from 1 2 3
    assert src.extend(seq, 2) == (after_tails(LONG_HIGH), [4, 5])


def test_the_ledger_counts_each_source_and_a_later_run_only_after_the_earlier_was_accepted():
    ledger = DraftLedger()
    seq = _seq([1, 2, 3])
    ext = after_tails(LONG_HIGH)
    # two tail drafts, then two of the table: all tails and one table draft accepted
    assert ledger.count(seq, [TAILS, TAILS, ext, ext], 3) == (2, 1)
    assert (seq.draft.num_drafted, seq.draft.num_accepted) == (4, 3)
    assert (seq.draft.drafted_by_pos, seq.draft.accepted_by_pos) == ([1, 1], [1, 1])
    assert seq.draft.context_by_pos[ext] == ([1, 1], [1, 0]) == ledger.seen[ext]
    # one tail draft rejected: the table's run is drafted (checked) but says nothing of the table by position
    assert ledger.count(seq, [TAILS, TAILS, ext], 1) == (1, 0)
    st = seq.draft
    assert (st.num_drafted, st.num_accepted, st.num_context_drafted, st.num_context_accepted) == (7, 4, 3, 1)
    assert (seq.draft.drafted_by_pos, seq.draft.accepted_by_pos) == ([2, 2], [2, 1])
    assert seq.draft.context_by_pos[ext] == ([1, 1], [1, 0]) == ledger.seen[ext]
    # a cycle of prompt lookup alone: its own counts, the tails' untouched
    assert ledger.count(seq, [LOOKUPS[3]] * 3, 2) == (3, 2)
    assert seq.draft.context_by_pos[LOOKUPS[3]] == ([1, 1, 1], [1, 1, 0]) == ledger.seen[LOOKUPS[3]]
    assert (seq.draft.drafted_by_pos, seq.draft.accepted_by_pos) == ([2, 2], [2, 1])
    assert seq.draft.num_context_drafted - 3 == 3 and seq.draft.num_context_accepted == 3


def test_the_engine_wide_counts_halve_past_a_thousand_cycles():
    ledger = DraftLedger()
    for _ in range(1001):
        ledger.count(_seq([1]), [LOOKUPS[2]], 1)
    d, a = ledger.seen[LOOKUPS[2]]
    assert d == [500] and a == [500]  # halved once, at the 1,001st
