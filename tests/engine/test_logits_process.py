"""Penalties, logit bias, grammars and log-probabilities on the real SmolLM2, against the base model's own
whole-sequence forward with the shaping written out here (the reference computation), for the base engine at
τ = 1 and for the shipped variant's exact profile (verified cycles with real drafts)."""

from __future__ import annotations

import json

import pytest
import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.paths import SHIPPED_VARIANTS

CHAT = [{"role": "user", "content": "List three fruits and their colours."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def engines():
    spec = engine_spec(None, "smollm2-135m-dmtd", search_dirs=[SHIPPED_VARIANTS])
    variant = build_engine(spec, EngineConfig(max_num_seqs=4, max_model_len=512))
    base = build_engine(engine_spec(None, "none"), EngineConfig(max_num_seqs=4, max_model_len=512))
    return variant, base


def base_logits(model, ids: list[int]) -> torch.Tensor:
    """The base model's logits [T, V] over the whole sequence (every position a head, replace routing)."""
    x = torch.tensor([ids])
    return model.forward_masked(x, torch.ones_like(x), DMTDConfig.plain(30, 8, 1))[0].float()


def penalised(row: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The reference shaping of one row: repetition (prompt and output), frequency and presence (output), bias."""
    row = row.clone()
    for t in set(prompt) | set(out):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        row[t] += b
    return row


def reference_greedy(smollm2, prompt: list[int], p: SamplingParams, n: int, allowed=None) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        row = penalised(base_logits(smollm2.model, prompt + out)[-1], prompt, out, p)
        if allowed is not None:
            row = row.masked_fill(~allowed(out), float("-inf"))
        out.append(int(row.argmax()))
        if out[-1] == smollm2.tokenizer.eos_token_id:
            break
    return out


def test_exact_logprobs_are_the_base_models_own(engines, smollm2):
    variant, base = engines
    p = SamplingParams(max_new_tokens=24, tau=3, exact=True, logprobs=5, ignore_eos=True)
    got = variant.generate([CHAT], p)[0]
    assert got.num_accepted > 0  # drafts were accepted: the logprobs still come from the verifier's rows
    lp = torch.log_softmax(base_logits(smollm2.model, got.prompt_token_ids + got.token_ids), -1)
    start = len(got.prompt_token_ids) - 1
    assert [e[0] for e in got.logprobs] == got.token_ids
    for j, (tok, piece, logprob, top) in enumerate(got.logprobs):
        ref = lp[start + j]
        assert abs(logprob - float(ref[tok])) < 1e-4, (j, logprob, float(ref[tok]))
        assert [t for t, _, _ in top] == ref.topk(5).indices.tolist()
        assert all(abs(v - float(ref[t])) < 1e-4 for t, _, v in top)
        assert piece == smollm2.tokenizer.decode([tok]).encode() or "\ufffd" in smollm2.tokenizer.decode([tok])
    plain = base.generate([CHAT], SamplingParams(max_new_tokens=24, tau=1, ignore_eos=True))[0]
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.5, frequency_penalty=0.5),
                                dict(repetition_penalty=1.6),
                                dict(logit_bias={330: 8.0, 28: -100.0}, frequency_penalty=-0.3)])
def test_penalties_and_bias_change_tokens_as_the_reference_says(engines, smollm2, kw):
    variant, base = engines
    prompt = base.encode(CHAT)
    n = 20
    ref = reference_greedy(smollm2, prompt, SamplingParams(**kw), n)
    assert ref != reference_greedy(smollm2, prompt, SamplingParams(), n)  # the shaping matters here
    exact = variant.generate([CHAT], SamplingParams(max_new_tokens=n, tau=3, exact=True, **kw))[0]
    plain = base.generate([CHAT], SamplingParams(max_new_tokens=n, tau=1, **kw))[0]
    assert plain.token_ids == ref
    assert exact.token_ids == ref
    assert exact.num_drafted > 0


def test_json_schema_output_parses_and_equals_the_constrained_base(engines, smollm2):
    import llguidance
    import llguidance.hf
    from llguidance.torch import fill_next_token_bitmask

    variant, base = engines
    chat = [{"role": "user", "content": "Describe a person called Ada as JSON with name, age and tags."}]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    tok = llguidance.hf.from_tokenizer(smollm2.tokenizer, n_vocab=49152)

    def allowed(out: list[int]) -> torch.Tensor:
        m = llguidance.LLMatcher(tok, grammar)
        assert m.consume_tokens(out) or not out
        bm = torch.zeros(1, 1536, dtype=torch.int32)
        fill_next_token_bitmask(m, bm, 0)
        return ((bm[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(-1)

    prompt = base.encode(chat)
    ref = reference_greedy(smollm2, prompt, SamplingParams(), 90, allowed)
    exact = variant.generate([chat], SamplingParams(max_new_tokens=90, tau=3, exact=True, grammar=grammar))[0]
    plain = base.generate([chat], SamplingParams(max_new_tokens=90, tau=1, grammar=grammar))[0]
    assert exact.token_ids == plain.token_ids == ref
    assert exact.finish_reason == "stop" and exact.num_drafted > 0
    obj = json.loads(exact.text)
    assert set(obj) == {"name", "age", "tags"} and isinstance(obj["age"], int)


def test_sampled_exact_with_a_grammar_stays_valid_json(engines):
    import llguidance

    variant, _ = engines
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    chat = [{"role": "user", "content": "A person as JSON, please."}]
    outs = variant.generate([chat] * 3, [SamplingParams(temperature=0.9, seed=s, max_new_tokens=80, tau=3,
                                                        exact=True, grammar=grammar, presence_penalty=0.4,
                                                        logprobs=0) for s in (1, 2, 3)])
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert set(json.loads(o.text)) == {"name", "age", "tags"}
        assert len(o.logprobs) == len(o.token_ids) - 1 and all(e[2] <= 0.0 and e[3] == [] for e in o.logprobs)


def test_bad_shaping_is_refused_naming_the_field(engines):
    variant, _ = engines
    with pytest.raises(RequestError, match="logit_bias"):
        variant.add_request(variant.encode(CHAT), SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(RequestError, match="response_format"):
        variant.add_request(variant.encode(CHAT),
                            SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: @@@"}]}'))
    with pytest.raises(RequestError, match="top_logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(RequestError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    assert not variant.has_unfinished() and not variant.shaper.states


def test_a_grammars_forced_tokens_are_drafts_the_verifier_accepts(engines):
    import re

    import llguidance

    from dmtd.engine.logits_process import FORCED_SOURCE

    variant, base = engines
    grammar = llguidance.LLMatcher.grammar_from_regex(r"The answer is (yes|no)\.")
    chat = [{"role": "user", "content": "Is water wet?"}]

    def forced_accepted() -> int:
        return sum(variant.cycles.ledger.seen.get(FORCED_SOURCE, ([], []))[1])

    before = forced_accepted()
    exact = variant.generate([chat], SamplingParams(max_new_tokens=12, tau=4, exact=True, grammar=grammar))[0]
    plain = base.generate([chat], SamplingParams(max_new_tokens=12, tau=1, grammar=grammar))[0]
    assert exact.token_ids == plain.token_ids and re.fullmatch(r"The answer is (yes|no)\.", exact.text)
    assert forced_accepted() - before >= 3  # "The answer is" went by as drafts, no tail pass made them
    for seed in (1, 2):
        sampled = variant.generate([chat], SamplingParams(temperature=1.0, seed=seed, max_new_tokens=12, tau=4,
                                                          exact=True, grammar=grammar))[0]
        assert re.fullmatch(r"The answer is (yes|no)\.", sampled.text) and sampled.finish_reason == "stop"


def test_min_tokens_keeps_eos_stop_tokens_and_stop_strings_from_ending_the_output_before_it(engines):
    """vLLM's ``min_tokens``: EOS and the stop tokens are masked out of the rows before it, stop strings wait for it;
    the exact profile checks its drafts against the masked rows, so its tokens are the base's."""
    variant, base = engines
    eos = base.tokenizer.eos_token_id
    prompt = base.encode(CHAT)
    eager = {"max_new_tokens": 16, "logit_bias": {eos: 100.0}}  # EOS first wherever it may come
    assert base.generate([prompt], SamplingParams(**eager))[0].token_ids == [eos]
    outs = [e.generate([prompt], SamplingParams(**eager, min_tokens=6, **kw))[0]
            for e, kw in ((base, {}), (variant, {"exact": True, "tau": 3}))]
    for out in outs:
        assert out.token_ids[-1] == eos and len(out.token_ids) == 7 and out.finish_reason == "stop"
    assert outs[0].token_ids == outs[1].token_ids
    plain = base.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop_id = plain.token_ids[1]
    assert len(base.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_id]))[0].token_ids) <= 2
    late = base.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_id], min_tokens=5))[0]
    assert stop_id not in late.token_ids[:5] and len(late.token_ids) >= 5
    word = base.tokenizer.decode(plain.token_ids[:2]).strip().split()[0]  # a stop string in the answer's first words
    early = base.generate([prompt], SamplingParams(max_new_tokens=12, stop=[word]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    kept = base.generate([prompt], SamplingParams(max_new_tokens=12, stop=[word], min_tokens=8))[0]
    assert len(kept.token_ids) >= 8 and kept.token_ids[:8] == plain.token_ids[:8]
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
