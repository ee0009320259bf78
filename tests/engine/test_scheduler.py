"""The torch-free scheduler: admission, slots, phases, blocks, retirement — as plain Python."""

from __future__ import annotations

import pytest

from dmtd.engine.config import DMTDConfig
from dmtd.engine.scheduler import CapacityError, Scheduler, StepPlan
from dmtd.engine.sequence import RequestError, SamplingParams, Sequence


def make(max_num_seqs=2, max_len=32, tau_max=4, anchor="prompt_end"):
    return Scheduler(DMTDConfig(0, 3, 1, tau_max, anchor), max_num_seqs, max_len, 64)


def seq(rid, n=4, tau=3, **kw):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(**kw), tau=tau)


def drive(s: Scheduler, tokens_of, conf=0.9, eos_ids=frozenset({0})):
    out = s.schedule()
    if out.prefill:  # the prompt chunks are computed (by the runner, in the engine): the completed ones run
        out = StepPlan(prefill=s.prefilled(out.prefill))
    toks = [tokens_of(q) for q in out.seqs]
    return out, s.postprocess(out, toks, [conf] * len(toks), eos_ids=eos_ids)


def test_admission_respects_slots_and_frees_them():
    s = make(max_num_seqs=2)
    for r in "abc":
        s.add(seq(r, max_new_tokens=3))
    out, _ = drive(s, lambda q: 5)
    assert [q.req_id for q in out.prefill] == ["a", "b"] and s.num_free_kv_rows == 0
    assert [q.req_id for q in s.waiting] == ["c"]
    for _ in range(2):
        out, ev = drive(s, lambda q: 5)
        assert not out.is_prefill
    assert all(e.finished and e.finish_reason == "length" for e in ev)
    assert s.num_free_kv_rows == 2
    out, _ = drive(s, lambda q: 5)
    assert [q.req_id for q in out.prefill] == ["c"] and out.prefill[0].kv_row == 0


def test_phases_and_blocks_prompt_end():
    s = make()
    s.add(seq("a", n=5, tau=3, max_new_tokens=7))
    heads, blocks = [], []
    while s.num_unfinished:
        _, ev = drive(s, lambda q: 7)
        heads += [e.is_head for e in ev]
        blocks += [e.block for e in ev if e.block]
    assert heads == [True, False, False, True, False, False, True]
    assert [len(b) for b in blocks] == [3, 3, 1]


def test_absolute_anchor_heads_on_multiples_of_tau():
    s = make(anchor="absolute")
    s.add(seq("a", n=5, tau=3, max_new_tokens=7))  # positions 4..10 produce tokens
    heads = []
    while s.num_unfinished:
        _, ev = drive(s, lambda q: 7)
        heads += [e.is_head for e in ev]
    assert heads == [p % 3 == 0 for p in range(4, 11)]


def test_low_confidence_tail_token_is_dropped_and_redone_at_a_head():
    s = make()
    s.add(seq("a", n=4, tau=4, max_new_tokens=6, min_confidence=0.5))
    confs = [0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9]
    evs = []
    for i, c in enumerate(confs):
        evs += drive(s, lambda q, i=i: 10 + i, c, set())[1]
    # step 2 (a tail, conf .2) is dropped: no token, the block so far closes, and the same position
    # runs again as a head at step 3
    assert [e.token_id for e in evs] == [10, 11, -1, 13, 14, 15, 16]
    assert [e.is_head for e in evs] == [True, False, False, True, False, False, False]
    assert evs[2].position == evs[3].position == 5
    assert evs[2].block == [10, 11] and evs[-1].block == [13, 14, 15, 16]
    assert evs[-1].finished and evs[-1].finish_reason == "length"
    seq_a = evs[-1]
    assert seq_a.req_id == "a"
    # a low-confidence token from a head is kept, and the next position is a head too (no tail is tried
    # after an uncertain token); a confident head token is followed by a tail as usual
    s.add(seq("b", n=4, tau=3, max_new_tokens=4, min_confidence=0.5))
    evs = []
    for c in (0.1, 0.9, 0.9, 0.9):
        evs += drive(s, lambda q: 7, c, set())[1]
    assert [e.token_id for e in evs] == [7, 7, 7, 7]
    assert [e.is_head for e in evs] == [True, True, False, False]
    assert [e.block for e in evs if e.block] == [[7], [7, 7, 7]]


def test_stop_token_and_eos():
    s = make()
    s.add(seq("a", stop_token_ids=[9], max_new_tokens=10))
    _, ev = drive(s, lambda q: 9)
    assert ev[0].finished and ev[0].finish_reason == "stop" and ev[0].block == [9]
    s.add(seq("b", max_new_tokens=10, ignore_eos=True))
    _, ev = drive(s, lambda q: 0)
    assert not ev[0].finished


def test_bad_requests_are_rejected_before_admission():
    s = make(max_len=8)
    with pytest.raises(CapacityError, match="prompt"):
        s.add(seq("long", n=8))
    with pytest.raises(RequestError, match="prompt"):
        s.add(Sequence("empty", [], SamplingParams(), tau=1))
    with pytest.raises(RequestError, match="tau"):
        s.add(seq("t", tau=5))
    assert s.num_unfinished == 0 and s.num_free_kv_rows == 2


def test_finish_is_idempotent_and_frees_waiting_too():
    s = make(max_num_seqs=1)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, "abort")
    s.finish(a, "abort")
    s.finish(a, "abort")
    assert s.num_unfinished == 0 and s.num_free_kv_rows == 1


@pytest.mark.parametrize("field,kw", [
    ("temperature", {"temperature": -1}), ("top_p", {"top_p": 0}), ("top_k", {"top_k": -2}),
    ("max_new_tokens", {"max_new_tokens": 0}), ("min_confidence", {"min_confidence": 1.5}),
    ("tau", {"tau": 0}), ("stop", {"stop": [""]}),
])
def test_sampling_params_name_the_field(field, kw):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def rows_scheduler(max_num_seqs=4, max_len=2048, long_prefill_tokens=512) -> Scheduler:
    """Prompts as rows (split anywhere), the prefix cache by pages: the engine's scheduler on a CPU in bf16."""
    s = Scheduler(DMTDConfig(0, 3, 1, 4, "prompt_end"), max_num_seqs, max_len, 4096, cache_chunk=16,
                  long_prefill_tokens=long_prefill_tokens)
    s.free_split = True
    return s


def prompt(rid, tokens, **kw):
    return Sequence(rid, list(tokens), SamplingParams(**{"max_new_tokens": 4, **kw}), tau=1)


def finish_prefill(s: Scheduler, out: StepPlan) -> list[str]:
    """The runner computed the step's prompt positions: the prompts it completed, by id."""
    return [q.req_id for q in s.prefilled(out.prefill or out.ride)]


def test_prompts_as_rows_the_least_work_first_each_prompt_in_a_step_of_its_own():
    s = rows_scheduler()
    s.add(prompt("long", range(1, 1501)))
    s.add(prompt("short", range(5000, 5040)))
    s.add(prompt("mid", range(7000, 7800)))
    order = []
    while s.prefilling or s.waiting:
        out = s.schedule()
        assert len(out.prefill) == 1  # each a step of its own: the first ones answer before the long one is done
        order += finish_prefill(s, out)
        s.running.clear()  # (nothing decodes in between: every step is a whole-prompt step)
    assert order == ["short", "mid", "long"]


def test_a_prompt_whose_system_prompt_another_is_computing_waits_and_reads_its_pages():
    s = rows_scheduler()
    system = list(range(1, 801))
    s.add(prompt("a", system + [9001, 9002]))
    s.add(prompt("b", system + [9003, 9004, 9005]))
    out = s.schedule()
    assert [q.req_id for q in out.prefill] == ["a"]  # b is admitted but computes nothing of a's system prompt
    b = next(q for q in s.prefilling if q.req_id == "b")
    assert b.num_prefilled == 0
    finish_prefill(s, out)
    s.running.clear()
    out = s.schedule()
    assert [q.req_id for q in out.prefill] == ["b"]
    assert b.num_cached_tokens == 800 and b.prefill_end == 803  # a's 50 published pages, its own 3 positions
    assert s.prefix.stats.cached_tokens == 800


def at_head(s: Scheduler) -> None:
    """The running rows' next positions are heads (as a τ = 1 row's always are)."""
    for q in s.running:
        q.next_head_pos = q.position


def test_beside_decoding_a_short_prompt_rides_whole_and_a_long_one_is_paced():
    s = rows_scheduler(long_prefill_tokens=512)
    s.add(prompt("stream", range(1, 9), max_new_tokens=100))
    finish_prefill(s, s.schedule())
    s.prefill_budget = 20_000.0  # the pacer runs
    s.ride_budgets = {"check": None, "head": 20_000.0}  # keys the pacer grants a head step's riding prompt rows
    at_head(s)
    s.add(prompt("long", range(100, 1100)))
    out = s.schedule()
    assert [q.req_id for q in out.decode] == ["stream"] and not out.prefill  # the stream's step carries it
    long = out.ride[0]
    assert long.req_id == "long" and 0 < long.prefill_end - long.num_prefilled < 100  # a paced piece
    finish_prefill(s, out)
    s.add(prompt("short", range(3000, 3400)))
    at_head(s)
    out = s.schedule()
    short = next(q for q in out.ride if q.req_id == "short")
    assert short.num_prefilled == 0 and short.prefill_end == 400  # whole, beyond the step's budget
    assert finish_prefill(s, out) == ["short"]
    assert s.num_rides == 2


def test_a_prompt_beside_unverified_rows_waits_for_their_head_step_and_an_exact_one_gets_its_own():
    s = Scheduler(DMTDConfig(0, 3, 1, 4, "prompt_end"), 4, 2048, 4096, cache_chunk=16, long_prefill_tokens=512)
    s.free_split = True
    stream = Sequence("stream", list(range(1, 9)), SamplingParams(max_new_tokens=100), tau=3)
    s.add(stream)
    finish_prefill(s, s.schedule())
    s.prefill_budget, s.ride_budgets = 20_000.0, {"check": None, "head": 20_000.0}
    stream.next_head_pos = stream.position + 2  # two tail steps to its head
    s.add(prompt("chat", range(100, 140)))
    for _ in range(2):  # tail steps: the prompt waits (its rows need the thinking group a head step runs)
        out = s.schedule()
        assert out.decode == [stream] and not out.prefill and not out.ride
        stream.token_ids.append(7)
    out = s.schedule()
    assert out.decode == [stream] and [q.req_id for q in out.ride] == ["chat"]
    assert finish_prefill(s, out) == ["chat"]
    # an exact prompt needs the verifying path, which only a check runs: beside unverified rows, a step of its own
    s.add(prompt("exact", range(200, 240), exact=True))
    out = s.schedule()
    assert [q.req_id for q in out.prefill] == ["exact"] and not out.ride


def test_prompts_admitted_together_start_together_where_a_dmtd_rows_phases_follow_the_shared_clock():
    s = Scheduler(DMTDConfig(0, 3, 1, 4, "prompt_end"), 4, 2048, 4096, align_phases=True, cache_chunk=16)
    s.free_split = True
    s.add(prompt("long", range(1, 901), exact=True))
    s.add(prompt("dmtd", range(5000, 5040)))  # its tokens depend on its phases: it starts with the rest
    out = s.schedule()
    assert sorted(q.req_id for q in out.prefill) == ["dmtd", "long"]


def test_beside_decoding_short_prompts_after_the_first_come_as_the_budget_pays_for_them():
    s = rows_scheduler(long_prefill_tokens=512)
    s.add(prompt("stream", range(1, 9), max_new_tokens=100))
    finish_prefill(s, s.schedule())
    for i in range(4):  # four 100-token prompts arrive together, ~46k keys each; exact ones beside unverified rows
        # alone take steps of their own (only a check runs the verifying path)
        s.add(prompt(f"p{i}", range(1000 * (i + 1), 1000 * (i + 1) + 100), exact=i > 0))
    s.prefill_budget = 60_000.0
    out = s.schedule()
    assert [q.req_id for q in out.prefill] == ["p0"]  # the first whole beyond the budget, the next not within it
    s.prefill_budget = 100_000.0
    finish_prefill(s, out)
    out = s.schedule()
    if not out.prefill:  # (a decode step between two prefill steps)
        out = s.schedule()
    assert [q.req_id for q in out.prefill] == ["p1", "p2"]


def test_the_prefill_planner_works_on_the_schedulers_own_queues_and_ages_a_waiting_prompt():
    """The scheduler's PrefillPlanner is given its queues (the same objects) and its admission: what it plans is the
    scheduler's step, the keys it returns are the step's, and a prompt's age in schedule() calls halves its work at
    AGE_STEPS."""
    from dmtd.engine.prefill_pacer import prompt_cost
    from dmtd.engine.prefill_plan import AGE_STEPS

    s = rows_scheduler()
    p = s.planner
    assert p.waiting is s.waiting and p.prefilling is s.prefilling and p.running is s.running
    s.add(prompt("a", range(1, 201)))
    out = s.schedule()
    assert [q.req_id for q in out.prefill] == ["a"] and s.prefilling == out.prefill
    assert out.prefill_keys == prompt_cost(0, 200) > 0
    b = prompt("b", range(300, 500))
    s.add(b)  # queued at the current schedule() count
    assert p.order(b, s.num_schedules) == prompt_cost(0, 200)
    assert p.order(b, s.num_schedules + AGE_STEPS) == prompt_cost(0, 200) / 2
    s.finish(b, "abort")
    assert b.seq_no not in p.queued_at
