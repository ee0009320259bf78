"""Prompts prefilled while others decode: split anywhere where prompts run as rows, paced by measured step times,
riding on the exact profile's check passes and the unverified profile's head steps — and every token the one a prompt
prefilled alone gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmtd.engine.config import ConfigError, EngineConfig
from dmtd.engine.prefill_pacer import PrefillPacer, end_within, prompt_cost
from dmtd.engine.sequence import SamplingParams


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 8000), extra=st.integers(1, 4000), units=st.floats(-10, 5e6))
def test_end_within_takes_the_most_positions_the_budget_pays_for_and_at_least_one(start, extra, units):
    target = start + extra
    end = end_within(start, target, units)
    assert start < end <= target
    assert end == start + 1 or prompt_cost(start, end) <= units
    assert end == target or prompt_cost(start, end + 1) > units
    # the cost is the keys each position reads plus a fixed part a position
    assert prompt_cost(start, end) == sum(p + 1 + 320 for p in range(start, end))


def test_the_pacer_spends_credit_earned_by_decode_steps_and_fits_a_prefill_steps_time():
    pacer = PrefillPacer(1.0)
    assert pacer.budget() == 0.0  # no credit yet: a step of one position
    pacer.observe_decode(20.0, prompt_waiting=True)
    first = pacer.budget()
    assert first == pytest.approx(20.0 / 2e-3)  # the cautious guess before any prefill step
    for keys, ms in [(1000, 11.0), (3000, 13.0), (5000, 15.0)]:  # 10 ms fixed, 1 µs a key
        pacer.observe_prefill(keys, ms, paced=True)
    assert pacer.fit() == pytest.approx((10.0, 1e-3))
    assert pacer.credit_ms == pytest.approx(20.0 - 39.0)
    assert pacer.budget() == -1.0  # spent: decode first
    pacer.observe_decode(30.0, prompt_waiting=True)
    pacer.observe_decode(30.0, prompt_waiting=True)
    assert pacer.budget() == pytest.approx((41.0 - 10.0) / 1e-3)
    pacer.observe_decode(5.0, prompt_waiting=False)  # nothing waits: credit goes
    assert pacer.credit_ms == 0.0
    pacer.observe_carrier("check", 16.0, 0.0)
    pacer.observe_carrier("check", 40.0, 16000.0)  # 24 ms beyond the check for 16,000 keys: 1.5 µs a key
    assert pacer.ride_budget("check") == pytest.approx(16.0 / 1.5e-3)
    # each carrier keeps its own step time and rides: a head step's (8 ms, 2 ms fixed + 1 µs a key)
    assert pacer.ride_budget("head") == pytest.approx(10.0 / 1.5e-3)  # the guesses before any head step
    pacer.observe_carrier("head", 8.0, 0.0)
    pacer.observe_carrier("head", 12.0, 2000.0)
    pacer.observe_carrier("head", 14.0, 4000.0)
    assert pacer.ride_budget("head") == pytest.approx((8.0 - 2.0) / 1e-3)
    assert pacer.ride_budget("check") == pytest.approx(16.0 / 1.5e-3)
    assert PrefillPacer(0.0).budget() is None and PrefillPacer(0.0).ride_budget("check") is None


@pytest.mark.parametrize("pace", [-1.0, float("nan"), float("inf")])
def test_a_bad_pace_is_refused_naming_the_field(pace):
    with pytest.raises(ConfigError, match="prefill_pace"):
        EngineConfig(prefill_pace=pace)


def _smollm2(variant: str, dtype: str, **cfg):
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    spec = engine_spec(None, variant, dtype=getattr(torch, dtype), search_dirs=[SHIPPED_VARIANTS])
    return build_engine(spec, EngineConfig(**{"max_model_len": 1024, "dtype": dtype, **cfg}))


def _long_prompt(words: int) -> list[dict[str, str]]:
    system = " ".join(f"Rule {i}: answer about item {i * 7} kindly and in one sentence." for i in range(words))
    return [{"role": "system", "content": system}, {"role": "user", "content": "What is rule 3 about?"}]


def _stream_with_arrivals(e, stream, arrivals, params, arrive_at=(6,)):
    """``stream`` decodes; ``arrivals[i]`` is added at its ``arrive_at[i]``-th step (the last value for the rest);
    every request's tokens."""
    rid = e.add_request(e.encode(stream), params[0])
    ids, step = [rid], 0
    when = [arrive_at[min(i, len(arrive_at) - 1)] for i in range(len(arrivals))]
    while e.has_unfinished():
        ids += [e.add_request(e.encode(p), q) for p, q, w in zip(arrivals, params[1:], when) if w == step]
        e.step()
        step += 1
    return [list(e.seqs[r].token_ids[e.seqs[r].prompt_len:]) for r in ids]


def test_smollm2_prompts_riding_on_checks_give_the_base_models_tokens():
    """bf16 (prompts as rows): a ~900-token prompt, and later a second one sharing its system prompt, arrive while an
    exact stream decodes; their prefill is split over many steps and rides on the stream's check passes; every exact
    request's tokens are the base model's, each alone, and a dmtd-profile request's are its own alone."""
    from dmtd.bench.exact_bench import CHATS

    long_a, long_b = _long_prompt(50), _long_prompt(50)
    long_b[1]["content"] = "And rule 5?"
    stream = [{"role": "user", "content": CHATS[0]}]
    exact = SamplingParams(max_new_tokens=24, exact=True, ignore_eos=True)
    base = _smollm2("none", "bfloat16", max_num_seqs=1, prefix_caching=False)
    ref = [base.generate([p], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
           for p in (stream, long_a, long_b)]
    # long_prefill_tokens 0: these prompts (~900 tokens) are paced, as a longer one is by default
    e = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=4, adaptive_drafts=True, long_prefill_tokens=0)
    assert e.runner.rows_prefill()
    stream_params = SamplingParams(max_new_tokens=120, exact=True, ignore_eos=True)
    got = _stream_with_arrivals(e, stream, [long_a, long_b], [stream_params, exact, exact], arrive_at=(6, 40))
    assert e.scheduler.num_rides >= 4  # split over several check passes, not prefilled at once
    assert got[1] == ref[1] and got[2] == ref[2]
    assert got[0][:24] == ref[0]
    assert e.scheduler.prefix.stats.cached_tokens > 0  # the second found the first's system prompt
    assert e.scheduler.num_free_kv_rows == 4 and not e.has_unfinished()
    # the dmtd profile (its own tokens, not the base's) riding beside exact checks: the same as it alone (its
    # cycles anchored at its prompt's end, not at the batch's shared clock)
    dmtd = SamplingParams(max_new_tokens=16, tau=3, ignore_eos=True)
    alone = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=1, prefix_caching=False, prefill_pace=0.0,
                     align_phases=False)
    want = alone.generate([long_a], dmtd)[0].token_ids
    e2 = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=2, adaptive_drafts=True, align_phases=False,
                  long_prefill_tokens=0)
    got2 = _stream_with_arrivals(e2, stream, [long_a], [stream_params, dmtd])
    assert e2.scheduler.num_rides >= 4
    assert got2[1] == want and got2[0][:24] == ref[0]


def _tokens_and_logprobs(e, stream, arrivals, params, arrive_at):
    """As :func:`_stream_with_arrivals`; each request's (tokens, log-probabilities), in arrival order."""
    ids, step, outs = [e.add_request(e.encode(stream), params[0])], 0, {}
    while e.has_unfinished():
        ids += [e.add_request(e.encode(p), q) for p, q, w in zip(arrivals, params[1:], arrive_at) if w == step]
        for o in e.step():
            if o.token_id >= 0:
                outs.setdefault(o.req_id, []).append((o.token_id, o.logprob))
        step += 1
    return [outs[r] for r in ids]


@pytest.mark.parametrize("long_prefill_tokens", [2048, 0])
def test_smollm2_unverified_prompts_ride_on_head_steps_with_the_bits_they_have_alone(long_prefill_tokens):
    """bf16 (prompts as rows), only the dmtd profile running: prompts arriving while a stream decodes ride on the steps
    where rows reach their heads — taken whole (a chat prompt), or split over several head steps (paced, a ~900-token
    prompt) — and take no prefill step of their own; every request's tokens and log-probabilities are those it has
    alone (its cycles anchored at its own prompt's end: align_phases off)."""
    from dmtd.bench.exact_bench import CHATS

    chats = [[{"role": "user", "content": c}] for c in CHATS[:5]]
    arrivals = chats[1:] + [_long_prompt(50)]
    params = [SamplingParams(max_new_tokens=n, tau=t, ignore_eos=True, logprobs=2)
              for n, t in ((70, 3), (16, 3), (16, 2), (16, 4), (16, 3), (16, 3))]
    alone = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=1, prefix_caching=False, prefill_pace=0.0,
                     align_phases=False)
    want = [_tokens_and_logprobs(alone, p, [], [q], [])[0] for p, q in zip([chats[0], *arrivals], params)]
    e = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=6, align_phases=False,
                 long_prefill_tokens=long_prefill_tokens)
    got = _tokens_and_logprobs(e, chats[0], arrivals, params, arrive_at=(3, 4, 7, 11, 12))
    assert got == want
    # the stream's own prompt; every later one rode (paced, the long prompt's rest once the stream has ended: alone)
    assert e.pass_stats["prefill"][0] == (1 if long_prefill_tokens else 2)
    assert e.scheduler.num_rides >= (5 if long_prefill_tokens else 8)
    assert e.scheduler.num_free_kv_rows == 6 and not e.has_unfinished()


def test_an_exact_prompt_waiting_beside_unverified_rows_gets_its_own_prefill_step():
    """Only a check pass runs the verifying path an exact prompt needs: beside rows of the dmtd profile alone it is
    prefilled in a step of its own, and its tokens are the base model's."""
    from dmtd.bench.exact_bench import CHATS

    chats = [[{"role": "user", "content": c}] for c in CHATS[:2]]
    base = _smollm2("none", "bfloat16", max_num_seqs=1, prefix_caching=False)
    ref = base.generate([chats[1]], SamplingParams(max_new_tokens=16, ignore_eos=True))[0].token_ids
    e = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=2)
    got = _stream_with_arrivals(e, chats[0], [chats[1]], [SamplingParams(max_new_tokens=40, tau=3, ignore_eos=True),
                                                          SamplingParams(max_new_tokens=16, exact=True,
                                                                         ignore_eos=True)])
    assert got[1] == ref
    assert e.pass_stats["prefill"][0] == 2 and e.scheduler.num_rides == 0


def test_exact_prompts_drafts_kv_after_the_first_token_is_the_kv_computed_with_it():
    """The variant's decoding group over exact prompts runs at the next step's start (draft_kv_after_first_token):
    whole, riding on checks, shared through the prefix cache, copied to a fork, or owed by a request that ends at its
    first token, every request drafts and accepts what it does with that KV computed in its prefill."""
    from dmtd.bench.exact_bench import CHATS

    long_a = _long_prompt(50)
    long_b = long_a[:1] + [{"role": "user", "content": "And rule 9?"}]  # long_a's system prompt: its cached pages

    def run(defer: bool) -> tuple[list[tuple[list[int], int, int, list[int]]], object]:
        e = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=5, align_phases=False, align_checks=False,
                     draft_kv_after_first_token=defer)
        ex = [SamplingParams(max_new_tokens=n, exact=True, tau=3, ignore_eos=True) for n in (80, 1, 24)]
        ids, step = [e.add_request(e.encode([{"role": "user", "content": CHATS[0]}]), ex[0])], 0
        while e.has_unfinished():
            if step == 6:
                ids += [e.add_request(e.encode(long_a), ex[1]), e.add_request(e.encode(long_a), ex[2])]
            if step == 30:
                ids.append(e.add_request(e.encode(long_b), ex[2]))
                ids.append(e.add_request(e.encode(long_b), ex[2], prefill_with=ids[-1]))
            e.step()
            step += 1
        assert e.scheduler.num_rides >= 1 and e.cache_report()["prefix_hits"] >= 1
        return [(list(s.token_ids[s.prompt_len:]), s.draft.num_drafted, s.draft.num_accepted,
                 list(s.draft.accepted_by_pos))
                for s in (e.seqs[r] for r in ids)], e.pass_stats.get("catch_up")

    now, caught = run(False)
    later, catch_ups = run(True)
    assert caught is None and catch_ups is not None and catch_ups[0] >= 2
    assert later == now
    assert all(drafted > 0 for _, drafted, _, _ in now[2:])


def test_without_pacing_a_running_stream_meets_whole_chunks():
    """prefill_pace 0: a prompt arriving beside a stream takes prefill steps of prefill_chunk positions of its own
    (the engine before pacing), and nothing rides."""
    from dmtd.bench.exact_bench import CHATS

    e = _smollm2("smollm2-135m-dmtd", "bfloat16", max_num_seqs=2, adaptive_drafts=True, prefill_pace=0.0)
    params = SamplingParams(max_new_tokens=40, exact=True, ignore_eos=True)
    _stream_with_arrivals(e, [{"role": "user", "content": CHATS[0]}], [_long_prompt(40)], [params, params])
    assert e.scheduler.num_rides == 0
    assert e.pass_stats["prefill"][0] >= 3  # the stream's prompt, then the long one in chunks


def test_the_pace_rises_while_more_prompts_wait_than_sequences_decode():
    from dmtd.engine.prefill_pacer import MAX_PACE, PrefillPacer

    p = PrefillPacer(1.0)
    p.share(waiting=1, running=3)
    assert p.pace == 1.0  # fewer waiting than decoding: the configured pace
    p.share(waiting=3, running=1)
    assert p.pace == 3.0
    p.share(waiting=100, running=1)
    assert p.pace == MAX_PACE
    p.observe_carrier("check", 10.0, 0.0)
    q = PrefillPacer(1.0)
    q.observe_carrier("check", 10.0, 0.0)
    assert p.ride_budget("check") > q.ride_budget("check")  # a larger pace buys more keys a check
    off = PrefillPacer(0.0)
    off.share(waiting=5, running=1)
    assert off.pace == 0.0 and off.budget() is None  # no pacing stays no pacing
