"""The exact profile's draft length: the count with the most expected tokens per unit of measured cost."""

from __future__ import annotations

import pytest

from dmtd.engine.config import EngineConfig
from dmtd.engine.draft_policy import PassCosts, best_num_drafts, expected_tokens, worth_exploring
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_engine
from tests.engine.test_exact import DMTD, base_model, prompts_of


def test_expected_tokens_conditions_each_position_on_reaching_it():
    # 100 cycles drafted position 0, 80 accepted; 80 drafted position 1 after that, 40 accepted
    e = expected_tokens([80, 40], [100, 80], 2, prior=0.5)
    a1 = (80 + 2) / (100 + 4)
    a2 = (40 + 2) / (80 + 4)
    assert e == pytest.approx(1 + a1 + a1 * a2)
    assert expected_tokens([], [], 0) == 1.0


def test_best_count_follows_measured_costs_and_acceptance():
    cheap = PassCosts(checks={(1, 1): 1.0, (1, 2): 1.02, (1, 3): 1.04, (1, 4): 1.06}, drafts={1: 0.2})
    dear = PassCosts(checks={(1, 1): 1.0, (1, 2): 1.6, (1, 3): 2.2, (1, 4): 2.8}, drafts={1: 0.45})
    good = ([90, 80, 70], [100, 90, 80])  # accepted, drafted by position
    poor = ([20, 5, 1], [100, 20, 5])
    assert best_num_drafts(3, 1, cheap, *good) == 3
    assert best_num_drafts(3, 1, dear, *poor) == 0  # a plain base step pays best
    assert best_num_drafts(3, 1, cheap, *poor) in (0, 1)
    assert best_num_drafts(0, 1, cheap, *good) == 0


@pytest.mark.parametrize("think_scale,drafts_expected", [(0.0, True), (1.0, False)])
def test_adaptive_drafting_keeps_exactness_and_drafts_only_when_it_pays(think_scale, drafts_expected):
    base = base_model(1, think_scale)
    prompts = prompts_of([5, 9, 13, 4], 1)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=40, tau=1))
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=8, max_model_len=256, adaptive_drafts=True,
                                                   draft_quant="none",  # drafts as exact as the verifier
                                                   context_drafts=False,  # the tails' own policy
                                                   batch_gate=False),
                    default_tau=1, eos_token_ids=[])
    # costs as measured on a memory-bound machine: extra check positions and tails are cheap
    # (for every batch size the run passes through as requests finish, so no step's own timing enters)
    eng.cycles.pass_costs = PassCosts(checks={(b, r): 1.0 + 0.02 * r for b in range(1, 5) for r in range(1, 5)},
                               drafts={b: 0.25 for b in range(1, 5)})
    eng.cycles.pass_costs.decay = 1.0  # keep these costs (the tiny model's own timings are not the point here)
    got = eng.generate(prompts, SamplingParams(max_new_tokens=40, tau=4, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    drafted = sum(r.num_drafted for r in got)
    tokens = sum(len(r.token_ids) for r in got)
    if drafts_expected:  # every draft accepted: it keeps drafting the full τ − 1
        assert sum(r.num_accepted for r in got) == drafted and drafted > 0.5 * tokens
    else:  # nothing is accepted: after the prior wears off only the exploring cycles (1 in 8) draft, one each
        assert drafted <= 0.25 * tokens  # vs ~0.6 when every draft is accepted


def test_a_lone_rows_tail_is_charged_its_share_of_the_batch():
    """A draft pass of one row at batch 16 makes all 16 wait: per row it costs 16× its seconds ÷ the batch's
    step, so drafting that pays at batch 1 does not at batch 16 (and exploring it cannot pay either)."""
    costs = PassCosts(checks={(1, 1): 1.0, (1, 2): 1.05, (16, 1): 3.0, (16, 2): 3.2}, drafts={1: 0.45},
                      draft_rows=1.0, decay=0.5)
    assert costs.cycle_cost(1, 1) == pytest.approx(1.05 + 0.45)
    assert costs.cycle_cost(16, 1) == pytest.approx(3.2 / 3.0 + 0.45 * 16 / 3.0)
    good = ([70], [100])  # 70% of first drafts accepted
    assert best_num_drafts(1, 1, costs, *good) == 1
    assert best_num_drafts(1, 16, costs, *good) == 0
    assert worth_exploring(0, 1, 1, costs, [0], [100]) and not worth_exploring(0, 1, 16, costs, [0], [100])
    assert not worth_exploring(1, 1, 1, costs, *good)  # nothing further to draft
    costs.observe_draft(16, 9.9)  # the first passes of a shape pay one-off costs (TorchScript's profiling runs):
    costs.observe_draft(16, 9.9)  # not counted, so one slow first pass cannot stop all drafting for good
    assert 16 not in costs.drafts and costs.draft_rows == pytest.approx(1.0)
    costs.observe_draft(16, 1.6)  # 16 rows that draft together share one pass
    costs.observe_draft(16, 1.6)
    assert costs.draft_rows == pytest.approx(12.25) and costs.tail_share(16, 3.0) == pytest.approx(1.6 / 12 * 16 / 3)
    assert PassCosts(drafts={4: 0.5}).tail_share(4, 1.0) == pytest.approx(0.5)  # no sizes seen: the batch drafts


@pytest.mark.parametrize("draft_s,explores", [(0.5, True), (5.0, False)])
def test_exploring_cycles_draft_only_where_a_draft_could_pay(draft_s, explores):
    """Nothing is ever accepted here. Every 8th cycle tries one draft to keep measuring, if a draft that is
    always accepted would beat a plain step at these costs; a tail of 5 steps cannot, so none is tried."""
    base = base_model(1, 1.0)
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, adaptive_drafts=True,
                                                   context_drafts=False),
                    default_tau=1, eos_token_ids=[])
    eng.cycles.pass_costs = PassCosts(checks={(1, r): 1.0 + 0.1 * r for r in range(1, 5)}, drafts={1: draft_s},
                                      decay=1.0)
    res = eng.generate([prompts_of([6], 2)[0]], SamplingParams(max_new_tokens=48, tau=4, exact=True))[0]
    if explores:
        assert 0 < res.drafted_by_pos[0] <= 48 // 8 + 1  # the 1-in-8 exploring cycles, one draft each
    else:
        assert res.num_drafted == 0


def test_rarely_measured_costs_follow_the_machines_speed():
    """A check over 3 positions measured in a slow spell (every pass twice as slow) must not read as costly once
    the machine is fast again: rarely measured entries are scaled by the one-position check's drift since."""
    costs = PassCosts(decay=0.5)
    for _ in range(4):
        costs.observe_check(1, 1, 2.0)  # slow spell
    for _ in range(4):
        costs.observe_check(1, 3, 2.4)
        costs.observe_draft(1, 0.4)
    assert costs.cycle_cost(1, 2) == pytest.approx(1.2 + 2 * 0.2)
    for _ in range(12):
        costs.observe_check(1, 1, 1.0)  # fast again; nothing else measured meanwhile
    assert costs.checks[(1, 1)] == pytest.approx(1.0, abs=1e-3)
    assert costs.cycle_cost(1, 2) == pytest.approx(1.2 + 2 * 0.2, rel=1e-3)  # not 2.4 + 2 * 0.4
    assert best_num_drafts(2, 1, costs, [7, 5], [10, 7]) >= 1  # at the stale 2.4 + 2 × 0.4 it drafted none


def test_a_draft_that_resumes_after_plain_steps_is_not_counted_as_a_drafts_cost():
    """Little is accepted, so after the prior wears off mostly the 1-in-8 exploring cycles draft, each first
    catching its tail path up on the plain steps since (a pass over ~8 positions, ~2x a steady draft here).
    Counted, those passes read drafting as twice as costly as it is and a request that had stopped drafting
    never resumed (measured: 0 drafts over 8 chat requests); only passes of 1-2 positions are counted."""
    base = base_model(1, 1.0)
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, adaptive_drafts=True,
                                                   context_drafts=False),
                    default_tau=1, eos_token_ids=[])
    # a tail at half a step (held there: decay 1) so that drafting stops once the acceptance prior wears off
    eng.cycles.pass_costs = PassCosts(checks={(1, r): 1.0 + 0.1 * r for r in range(1, 5)}, drafts={1: 0.5}, decay=1.0)
    catch_ups: list[int] = []
    draft = eng.runner.draft

    def recording(seqs):
        catch_ups.append(max(s.draft_position - s.num_tail_cached + 1 for s in seqs))
        return draft(seqs)

    eng.runner.draft = recording  # type: ignore[method-assign]
    res = eng.generate([prompts_of([6], 2)[0]], SamplingParams(max_new_tokens=64, tau=4, exact=True))[0]
    assert res.num_accepted < 0.3 * res.num_drafted and any(c > 2 for c in catch_ups), catch_ups  # resumed
    steady = sum(c <= 2 for c in catch_ups)
    assert eng.cycles.pass_costs.seen.get(("draft", 1), 0) == steady  # every counted pass was a steady one


def test_a_fresh_engine_prices_a_tail_by_the_weight_bytes_it_reads():
    """Before any draft is measured, a tail costs its share of a step's weight bytes plus a pass's fixed costs
    (the flat prior tied one draft with a plain step at the prior acceptance, so a fresh engine drafted only in
    its exploring cycles). With int8 drafts the share is about a quarter of the bf16 layers' it replaces."""
    from dmtd.engine.draft_policy import TAIL_PASS_OVERHEAD

    base = base_model(1, 0.0)
    shares = {}
    for dq in ("none", "int8"):
        eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, adaptive_drafts=True,
                                                       draft_quant=dq), default_tau=1, eos_token_ids=[])
        assert eng.cycles.pass_costs.tail_prior == 0.45  # nothing known before an exact request
        eng.add_request(prompts_of([5], 1)[0], SamplingParams(max_new_tokens=4, tau=3, exact=True))
        r, d = eng.runner, DMTD
        layer = sum(t.numel() * t.element_size() for t in r.model.layer_weights()[0] if t is not None)
        head = r.head.numel() * r.head.element_size()
        tail_layers = d.num_encoding_layers + d.num_decoding_layers
        if dq == "none":
            assert r.draft_bytes_share() == pytest.approx((tail_layers * layer + head) / (d.num_layers * layer + head))
        shares[dq] = r.draft_bytes_share()
        assert eng.cycles.pass_costs.tail_prior == pytest.approx(min(0.45, shares[dq] + TAIL_PASS_OVERHEAD))
    assert shares["int8"] < 0.5 * shares["none"]


def test_the_batch_gate_measures_only_steps_where_a_row_could_draft():
    """τ = 1 rows run the same steps with drafts allowed or not: counted as windows with drafts, a replica's
    τ = 1 traffic read plain steps as drafts' goodput, and the exact default then drafted at batch 16 at 0.6×."""
    base = base_model(1, 0.0)
    prompts = prompts_of([5, 9, 13, 4], 1)
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=8, max_model_len=256, adaptive_drafts=True,
                                                   draft_quant="none"), default_tau=1, eos_token_ids=[])
    ref = eng.generate(prompts, SamplingParams(max_new_tokens=24, tau=1, exact=True))
    gate = eng.cycles.draft_gate
    assert gate.decisions == {} and gate.buckets == {}  # four rows at τ = 1: no window opened
    got = eng.generate(prompts, SamplingParams(max_new_tokens=24, tau=4, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert sum(gate.decisions.values()) > 0 and 4 in gate.buckets  # rows that could draft: windows are measured


def test_a_gate_window_holds_its_drafts_and_rows_take_its_mode_at_once():
    """Rows choose a cycle's drafts at its check; a window of the other mode that begins between two checks applies
    at once (VerifiedCycles.switch), and a window of drafts runs until its drafts are checked: every draft pass runs
    in a window of drafts. Cut at a fixed step count, a drafts window's last drafts were made and checked in the
    plain window after it, which the gate then credited with their tokens."""
    base = base_model(1, 0.0)
    prompts = prompts_of([5, 9, 13, 4], 1)
    eng = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=8, max_model_len=256, adaptive_drafts=True,
                                                   draft_quant="none"), default_tau=1, eos_token_ids=[])
    ref = eng.generate(prompts, SamplingParams(max_new_tokens=48, tau=1, exact=True))
    gate, draft, modes = eng.cycles.draft_gate, eng.runner.draft, []

    def spy(seqs):
        modes.append(gate.mode)
        return draft(seqs)

    eng.runner.draft = spy  # type: ignore[method-assign]
    got = eng.generate(prompts, SamplingParams(max_new_tokens=48, tau=4, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert gate.decisions.get("measure plain", 0) >= 2 and gate.decisions.get("measure drafts", 0) >= 1
    assert modes and all(modes), modes  # no draft pass in a plain window


def test_a_batchs_check_is_priced_by_the_marginal_cost_of_its_extra_rows():
    """At a batch of several, one row's drafts cost the check's measured marginal cost of its extra positions (in
    units of the row's share), not a check in which every row were as wide; alone, the measured width."""
    costs = PassCosts(decay=0.5, use_row_costs=True)
    for _ in range(4):
        costs.observe_check(16, 1, 1.0)  # the first passes of a kind are warm-up, not counted
    for _ in range(4):
        costs.observe_check(16, 3, 1.1, num_rows=20)  # two rows with two drafts each: 4 extra positions
    assert costs.row_costs[16] == pytest.approx(0.1 * 16 / 4)
    assert costs.check_cost(16, 2) == pytest.approx(1 + 2 * 0.4)
    for _ in range(4):
        costs.observe_check(16, 2, 1.4)  # every row one draft (num_rows: as if every row were that wide)
    assert costs.row_costs[16] == pytest.approx(0.4, abs=0.02)
    costs.observe_check(16, 2, 2.0, num_rows=17)  # one slow step with one extra position hardly moves it
    assert costs.row_costs[16] < 0.5
    alone = PassCosts(checks={(1, 1): 1.0, (1, 3): 1.05})
    alone.observe_check(1, 3, 1.05, num_rows=3)
    assert 1 not in alone.row_costs and alone.check_cost(1, 2) == pytest.approx(1.05)
    drafts = PassCosts(checks={(16, 1): 1.0}, drafts={16: 0.5}, row_costs={16: 0.25}, use_row_costs=True)
    # one row's cycle: its share of the check, its two extra positions, its two tails (0.5 s ÷ 16 rows per row share)
    assert drafts.cycle_cost(16, 2) == pytest.approx(1 + 2 * 0.25 + 2 * 0.5)
