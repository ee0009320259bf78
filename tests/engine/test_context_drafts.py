"""Context drafts (prompt lookup) in the exact profile: a cycle may check the tokens that followed an earlier
occurrence of the context's last few tokens instead of the tails' drafts; the output stays the verifier's."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmtd.engine.config import EngineConfig
from dmtd.engine.draft_gate import _Bucket
from dmtd.engine.draft_policy import PassCosts
from dmtd.engine.draft_sources import LOOKUPS
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import CONTEXT_NGRAMS, SamplingParams, Sequence
from tests.conftest import tiny_engine
from tests.engine.test_exact import DMTD, base_model, prompts_of


def _brute(ids: list[int], k: int, n: int) -> list[int]:
    if k == 0 or len(ids) < n:
        return []
    for e in range(len(ids) - 2, n - 2, -1):  # latest earlier end of the last n tokens
        if ids[e - n + 1: e + 1] == ids[-n:]:
            return ids[e + 1: e + 1 + k]
    return []


def test_the_continuation_follows_the_latest_earlier_occurrence():
    seq = Sequence("r", [1, 2, 3, 4, 5, 1, 2, 3], SamplingParams(), tau=3)
    assert seq.context_continuation(2, 3) == [4, 5]
    seq.token_ids += [7, 1, 2, 3]  # a later occurrence of 1 2 3 now comes first
    assert seq.context_continuation(3, 3) == [7, 1, 2]
    seq.token_ids += [9, 2, 3]  # 9 2 3 never came before; 2 3 did
    assert seq.context_continuation(3, 3) == [] and seq.context_continuation(3, 2) == [9, 2, 3]
    assert seq.context_continuation(0, 2) == []
    alone = Sequence("s", [1, 2, 3, 4], SamplingParams(), tau=3)
    assert alone.context_continuation(4, 3) == []  # the suffix is not its own match
    overlapping = Sequence("t", [5, 5, 5, 5], SamplingParams(), tau=3)
    assert overlapping.context_continuation(4, 3) == [5]  # the continuation runs up to the context's end


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(ids=st.lists(st.integers(0, 3), min_size=1, max_size=40), grow=st.lists(st.integers(0, 3), max_size=12),
       k=st.integers(0, 5), n=st.sampled_from(CONTEXT_NGRAMS))
def test_the_incremental_index_finds_what_a_scan_finds(ids, grow, k, n):
    seq = Sequence("r", list(ids), SamplingParams(), tau=3)
    assert seq.context_continuation(k, n) == _brute(seq.token_ids, k, n)
    for t in grow:  # the index grows with the context, one token or several between calls
        seq.token_ids.append(t)
        if t % 2:
            assert seq.context_continuation(k, n) == _brute(seq.token_ids, k, n)
    assert seq.context_continuation(k, n) == _brute(seq.token_ids, k, n)


def _engine(base, context: bool, costs: PassCosts | None = None) -> LLMEngine:
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=4, max_model_len=256, adaptive_drafts=True,
                                                   draft_quant="none", context_drafts=context),
                    default_tau=1, eos_token_ids=[])
    if costs is not None:
        eng.cycles.pass_costs = costs
    return eng


def _looping_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase: the lookups find it (a tiny random model's answers also fall into loops)."""
    rng = random.Random(5)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(97) for _ in range(rng.randrange(4, 9))]
        out.append([rng.randrange(97) for _ in range(3)] + phrase * 3)
    return out


@pytest.mark.parametrize("think_scale", [0.0, 1.0])
def test_context_drafts_keep_the_output_the_verifiers_and_are_counted_apart(think_scale):
    base = base_model(3, think_scale)
    prompts = _looping_prompts(3) + prompts_of([5, 11], 3)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=40, tau=1))
    costs = PassCosts(checks={(b, r): 1.0 + 0.05 * r for b in range(1, 6) for r in range(1, 8)},
                      drafts={b: 0.3 for b in range(1, 6)}, decay=1.0)
    got = _engine(base, True, costs).generate(prompts, SamplingParams(max_new_tokens=40, tau=3, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    for r in got:
        assert sum(map(len, r.blocks)) == len(r.token_ids)
        assert max(map(len, r.blocks)) <= 3  # τ bounds a block, context drafts' too
        assert 0 <= r.num_context_accepted <= r.num_context_drafted <= r.num_drafted  # drafted: both kinds
        assert 0 <= r.num_accepted <= r.num_drafted
        assert sum(r.accepted_by_pos) == r.num_accepted - r.num_context_accepted  # by position: the tails'
        assert sum(r.drafted_by_pos) == r.num_drafted - r.num_context_drafted
    drafted = sum(r.num_context_drafted for r in got)
    accepted = sum(r.num_context_accepted for r in got)
    assert drafted > 0 and accepted > 0  # the repeated phrases were found and some of them were right
    off = _engine(base, False, costs).generate(prompts, SamplingParams(max_new_tokens=40, tau=3, exact=True))
    assert [r.token_ids for r in off] == [r.token_ids for r in ref]
    assert sum(r.num_context_drafted for r in off) == 0


def test_context_drafts_stop_at_a_stop_token_and_need_greedy_and_the_adaptive_policy():
    base = base_model(3, 1.0)
    prompt = _looping_prompts(1)[0]
    ref = tiny_engine(base, DMTD).generate([prompt], SamplingParams(max_new_tokens=30, tau=1))[0]
    stop = ref.token_ids[6]
    first = ref.token_ids.index(stop)
    got = _engine(base, True).generate([prompt], SamplingParams(max_new_tokens=30, tau=3, exact=True,
                                                                stop_token_ids=[stop]))[0]
    assert got.token_ids == ref.token_ids[: first + 1] and got.finish_reason == "stop"
    sampled = _engine(base, True).generate([prompt], SamplingParams(max_new_tokens=30, tau=3, exact=True,
                                                                    temperature=1.0, seed=1))[0]
    assert sampled.num_context_drafted == 0  # sampled rows: drafts need the tail's distribution
    tau1 = _engine(base, True).generate([prompt], SamplingParams(max_new_tokens=30, tau=1, exact=True))[0]
    assert tau1.num_drafted == 0 and tau1.token_ids == ref.token_ids  # τ = 1: the verifier alone, no lookups
    fixed = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, adaptive_drafts=False),
                      default_tau=1, eos_token_ids=[])
    res = fixed.generate([prompt], SamplingParams(max_new_tokens=30, tau=3, exact=True))[0]
    assert res.num_context_drafted == 0 and res.token_ids == ref.token_ids  # fixed τ: the tails' drafts only


@pytest.mark.parametrize("mine,engine_wide,expect", [((0, 100), None, False), ((100, 100), None, True),
                                                     (None, (0, 100), False), (None, (90, 100), True)])
def test_the_policy_takes_context_drafts_only_where_they_pay(mine, engine_wide, expect):
    """A request whose context drafts were all rejected so far stops taking them, one whose were right goes on; a
    fresh request starts from what the engine's earlier requests saw (accepted, drafted at the first position)."""
    base = base_model(3, 1.0)
    prompt = _looping_prompts(1)[0]
    costs = PassCosts(checks={(1, r): 1.0 + 0.05 * r for r in range(1, 8)}, drafts={1: 0.3}, decay=1.0)
    eng = _engine(base, True, costs)
    if engine_wide is not None:
        eng.cycles.ledger.seen = {name: ([engine_wide[1]], [engine_wide[0]]) for name in LOOKUPS.values()}
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=20, tau=3, exact=True))
    eng.step()  # the prefill: its token decides this first cycle
    seq = eng.seqs[rid]
    seq.draft.clear()
    if mine is not None:
        seq.draft.context_by_pos = {name: ([mine[1]], [mine[0]]) for name in LOOKUPS.values()}
    seq.token_ids += prompt[-6:]  # make sure the context ends in a repeated phrase
    eng.cycles.from_context(seq)
    assert (set(seq.draft.sources) <= set(LOOKUPS.values()) and seq.draft.sources != []) is expect
    assert (len(seq.draft.tokens) > 0) is expect


def test_the_gates_plain_windows_keep_context_drafts_and_the_output():
    """Where the batch gate runs plain steps (tails' drafts lost to them at this batch size), the pass-free drafts
    still run, priced at the check's marginal cost of their rows; the output is still the verifier's."""
    base = base_model(3, 1.0)
    prompts = _looping_prompts(3)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=30, tau=1))
    costs = PassCosts(checks={(b, r): 1.0 + 0.05 * r for b in range(1, 6) for r in range(1, 8)},
                      drafts={b: 0.3 for b in range(1, 6)}, decay=1.0)
    costs.use_row_costs = True
    eng = _engine(base, True, costs)
    gate = eng.cycles.draft_gate
    for key in (2, 4):  # drafts measured at half the plain goodput at batch 2 and 3-4: every window plain
        gate.buckets[key] = _Bucket(readings=[0.5, 0.5])
    got = eng.generate(prompts, SamplingParams(max_new_tokens=30, tau=3, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert gate.decisions.get("plain pays", 0) > 0 and set(gate.decisions) == {"plain pays"}
    assert sum(r.num_context_drafted for r in got) > 0 and sum(r.num_context_accepted for r in got) > 0
