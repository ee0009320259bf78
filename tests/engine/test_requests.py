"""Request lifecycle: sampling, stop conditions, cancellation, bad input — and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.scheduler import CapacityError
from dmtd.engine.sequence import RequestError, SamplingParams
from tests.conftest import tiny_engine, tiny_model

DMTD = DMTDConfig(0, 4, 2, tau_max=4)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy():
    model = tiny_model(seed=1)
    p = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=123, max_new_tokens=24, tau=2)
    a = tiny_engine(model, DMTD).generate([[1, 2, 3]], p)[0]
    b = tiny_engine(model, DMTD).generate([[1, 2, 3]], p)[0]
    g = tiny_engine(model, DMTD).generate([[1, 2, 3]], SamplingParams(max_new_tokens=24, tau=2))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != g.token_ids


def test_top_k_one_equals_greedy():
    model = tiny_model(seed=1)
    a = tiny_engine(model, DMTD).generate([[4, 5]], SamplingParams(temperature=2.0, top_k=1, seed=0,
                                                                   max_new_tokens=16))[0]
    g = tiny_engine(model, DMTD).generate([[4, 5]], SamplingParams(max_new_tokens=16))[0]
    assert a.token_ids == g.token_ids


def test_top_p_keeps_only_the_nucleus():
    from dmtd.engine.sampler import sample

    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    seen = set()
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    for g in gens:
        toks, conf, ok = sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [g])
        seen.add(toks[0])
    assert seen == {0, 1}
    assert ok == [True] and conf[0] == pytest.approx(torch.softmax(logits, -1).max().item())


def test_cancel_mid_stream_frees_slot_and_others_continue():
    model = tiny_model(seed=4)
    engine = tiny_engine(model, DMTD, max_num_seqs=2)
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, tau=3))
    b = engine.add_request([7, 8], SamplingParams(max_new_tokens=10, tau=2))
    for _ in range(4):
        engine.step()
    assert engine.abort(a) is True
    assert engine.scheduler.num_free_kv_rows == 1
    assert engine.abort(a) is False
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.req_id for o in outs} == {b}
    assert outs[-1].finished and engine.scheduler.num_free_kv_rows == 2
    # the cancelled row's slot is reused and the new sequence is unaffected by stale cache rows
    c = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=40, tau=3))[0]
    solo = tiny_engine(model, DMTD).generate([[1, 2, 3]], SamplingParams(max_new_tokens=40, tau=3))[0]
    assert c.token_ids == solo.token_ids


def test_bad_input_is_rejected_with_the_field_and_others_keep_running():
    model = tiny_model(seed=4)
    engine = tiny_engine(model, DMTD, max_num_seqs=2, max_model_len=32)
    ok = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, tau=2))
    cases = [
        (lambda: engine.add_request([], SamplingParams()), "prompt", "empty"),
        (lambda: engine.add_request(list(range(1, 33)), SamplingParams()), "prompt", "context"),
        (lambda: engine.add_request([1], SamplingParams(tau=5)), "tau", "tau_max"),
        (lambda: engine.add_request([1], SamplingParams(tau=0)), "tau", ">= 1"),
        (lambda: engine.add_request([1000], SamplingParams()), "prompt_token_ids", "0..96"),
        (lambda: engine.add_request([1], SamplingParams(), req_id=ok), "request_id", "in use"),
    ]
    for fn, field, words in cases:
        with pytest.raises(RequestError) as e:
            fn()
        assert e.value.field == field and words in str(e.value)
    assert isinstance(pytest.raises(CapacityError, cases[1][0]).value, CapacityError)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.token_id for o in outs if o.req_id == ok].__len__() == 8
    assert engine.scheduler.num_free_kv_rows == 2 and engine.scheduler.num_unfinished == 0


def test_non_finite_logits_fail_one_request_only():
    model = tiny_model(seed=4)
    engine = tiny_engine(model, DMTD, max_num_seqs=3)
    good = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=12, tau=2))
    bad = engine.add_request([5, 6], SamplingParams(max_new_tokens=12, tau=2))
    engine.step()  # prefill both
    bad_slot = engine.seqs[bad].kv_row
    rows = [s.kv_row for s in engine.scheduler.running]
    orig = engine.runner.state.logits

    def poisoned(h):
        out = orig(h)
        if out.shape[0] == len(rows):
            out[rows.index(bad_slot)] = float("nan")
        return out

    engine.runner.state.logits = poisoned  # type: ignore[method-assign]
    outs = engine.step()
    engine.runner.state.logits = orig  # type: ignore[method-assign]
    failed = [o for o in outs if o.req_id == bad]
    assert failed and failed[0].finished and failed[0].finish_reason == "error"
    assert "non-finite" in (failed[0].error or "")
    while engine.has_unfinished():
        outs += engine.step()
    assert sum(1 for o in outs if o.req_id == good) == 11
    assert engine.scheduler.num_free_kv_rows == 3


def test_context_full_finishes_with_length():
    model = tiny_model(seed=4)
    engine = tiny_engine(model, DMTD, max_model_len=20)
    res = engine.generate([list(range(1, 16))], SamplingParams(max_new_tokens=100, tau=3))[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 5
    assert engine.scheduler.num_free_kv_rows == 8


def test_stop_strings_and_utf8_safe_text(smollm2):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, tau_max=4),
                       EngineConfig(max_num_seqs=2, max_model_len=256))
    full = engine.generate(["Count: one, two, three, four,"], SamplingParams(max_new_tokens=24, tau=1))[0]
    assert " six" in full.text
    stop = engine.generate(["Count: one, two, three, four,"],
                           SamplingParams(max_new_tokens=24, tau=1, stop=[" six"]))[0]
    assert stop.finish_reason == "stop"
    assert stop.text == full.text[: full.text.index(" six")]
    # multi-byte characters split across tokens are never emitted half-way
    emoji = engine.generate(["Emoji party: 🎉🎉🎉 and more 🎉"], SamplingParams(max_new_tokens=16, tau=1))[0]
    assert "\ufffd" not in emoji.text
    assert emoji.text == smollm2.tokenizer.decode(emoji.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_retune_changes_tau_and_the_gate_of_a_running_request_and_refuses_bad_values():
    """The replica's controller retunes requests through the engine's API: bad values name the field, a finished or
    unknown request is left alone."""
    eng = tiny_engine(tiny_model(seed=3), DMTD)
    rid = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, tau=2))
    eng.step()
    eng.retune(rid, tau=3, min_confidence=0.25)
    assert (eng.seqs[rid].tau, eng.seqs[rid].params.min_confidence) == (3, 0.25)
    for kw, field in (({"tau": 5}, "tau"), ({"tau": 0}, "tau"), ({"min_confidence": float("nan")}, "min_confidence"),
                      ({"min_confidence": 1.5}, "min_confidence")):
        with pytest.raises(RequestError) as e:
            eng.retune(rid, **kw)
        assert e.value.field == field
    assert (eng.seqs[rid].tau, eng.seqs[rid].params.min_confidence) == (3, 0.25)  # a refused call changed nothing
    eng.retune("no-such-request", tau=2)  # gone already: nothing to do
    while eng.has_unfinished():
        eng.step()
    eng.retune(rid, tau=1)
    assert eng.seqs[rid].tau == 3  # finished: left as it ended


def test_a_request_torch_refuses_at_admission_leaves_nothing_behind():
    """A seed torch's generator refuses (past SamplingParams' checks, as a replica's loop may hand it over): the call
    raises, no record, no queue entry, no cache row; the next request runs as if it never came."""
    eng = tiny_engine(tiny_model(seed=3), DMTD)
    with pytest.raises(RuntimeError, match="manual_seed"):
        eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.7, seed="x"), req_id="poison")
    assert "poison" not in eng.seqs and not eng.has_unfinished() and eng.num_waiting == 0
    assert eng.abort("poison") is False
    out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0]
    assert len(out.token_ids) == 4 and eng.scheduler.num_free_kv_rows == eng.cfg.max_num_seqs
