"""Verified cycles (the exact profile): tails draft, the next head checks, the output is the verifier's."""

from __future__ import annotations

import copy
import math
from itertools import product

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmtd.engine.config import ConfigError, DMTDConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.model import Transformer
from dmtd.engine.sequence import SamplingParams
from dmtd.engine.verifier import Verifier, snapshot_decoding_layers
from tests.conftest import tiny_engine, tiny_model

DMTD = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")


def base_model(seed: int, think_scale: float, **kw: object) -> Transformer:
    """A tiny model whose thinking layers are scaled toward identity: the smaller ``think_scale``, the
    closer a tail (which skips them) comes to the full stack, so acceptance ranges from ~0 to 1."""
    model = tiny_model(seed=seed, **kw)
    with torch.no_grad():
        for layer in model.layers[DMTD.thinking_start: DMTD.decoding_start]:
            layer.self_attn.o_proj.weight.mul_(think_scale)
            layer.mlp.down_proj.weight.mul_(think_scale)
    return model


def variant_of(base: Transformer, noise: float, seed: int) -> tuple[Transformer, Verifier]:
    """A "trained" variant: the base with its decoding group perturbed, verified by the base's own copy."""
    var = copy.deepcopy(base)
    verifier = Verifier("base", "replace", snapshot_decoding_layers(base, DMTD))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in var.layers[DMTD.decoding_start:]:
            for p in layer.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g))
    var._weights = None
    return var, verifier


def in_dtype(model: Transformer, verifier: Verifier, dtype: str) -> tuple[Transformer, Verifier]:
    """The variant and its verifier's layers cast to ``dtype`` (as engine_spec casts a loaded variant)."""
    if dtype == "float32":
        return model, verifier
    from dmtd.engine.model import LayerWeights

    prec = getattr(torch, dtype)
    return model.to(prec), Verifier(verifier.name, verifier.head_input, [
        LayerWeights._make(None if t is None else t.to(prec) for t in w) for w in verifier.layers])


def exact_engine(model: Transformer, verifier: Verifier | None = None, max_num_seqs: int = 8,
                 draft_vocab: list[int] | None = None, eos: list[int] | None = None) -> LLMEngine:
    from dmtd.engine.config import EngineConfig

    return LLMEngine(model, None, DMTD, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256),
                     default_tau=1, eos_token_ids=eos or [], verifier=verifier, draft_vocab=draft_vocab)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10_000), think_scale=st.sampled_from([0.0, 0.05, 0.2, 1.0]),
       noise=st.sampled_from([0.0, 0.02, 0.2]), taus=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5),
       threshold=st.sampled_from([0.0, 0.3, 0.8]), max_new=st.integers(1, 24))
def test_greedy_exact_equals_the_verifier_alone(seed, think_scale, noise, taus, lengths, threshold, max_new):
    """Mixed prompt lengths, τ per row, draft thresholds and acceptance patterns: the tokens are the base's."""
    base = base_model(seed % 7, think_scale)
    var, verifier = variant_of(base, noise, seed)
    prompts = prompts_of(lengths, seed)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=max_new, tau=1))
    params = [SamplingParams(max_new_tokens=max_new, tau=taus[i % len(taus)], exact=True,
                             min_confidence=threshold) for i in range(len(prompts))]
    got = exact_engine(var, verifier).generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    for r, p in zip(got, params):
        assert sum(map(len, r.blocks)) == len(r.token_ids)
        assert max(map(len, r.blocks)) <= p.tau  # a block: accepted drafts + the verifier's token
        assert 0 <= r.num_accepted <= r.num_drafted
        assert sum(r.accepted_by_pos) == r.num_accepted and sum(r.drafted_by_pos) == r.num_drafted


def test_acceptance_spans_none_to_all_and_rows_accept_different_counts():
    prompts = prompts_of([4, 9, 15, 6], 1)
    rates = {}
    for scale in (0.0, 1.0):
        base = base_model(1, scale)
        res = exact_engine(base).generate(prompts, SamplingParams(max_new_tokens=24, tau=4, exact=True))
        rates[scale] = sum(r.num_accepted for r in res) / sum(r.num_drafted for r in res)
    assert rates[0.0] == 1.0 and rates[1.0] < 0.2
    # in one shared step, rows accept different counts (nothing waits for a phase)
    base = base_model(1, 0.05)
    eng = exact_engine(base)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=24, tau=4, exact=True))
    mixed = False
    while eng.has_unfinished():
        counts = [o.num_accepted for o in eng.step() if o.block]
        mixed |= len(set(counts)) > 1
    assert mixed


def test_tails_follow_their_own_path_the_masked_forward_with_the_realised_heads():
    """Each draft that stayed a tail (made from committed inputs) is the variant's masked-forward prediction,
    with heads at the prompt and at every position whose verifier logits closed a block."""
    base = base_model(3, 0.0)
    var, verifier = variant_of(base, 0.02, 3)
    eng = exact_engine(var, verifier)
    prompt = prompts_of([9], 3)[0]
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=30, tau=4, exact=True))
    seq = eng.seqs[rid]
    drafts: list[tuple[int, list[int], int]] = []  # (position, inputs up to it, draft)
    heads = set(range(len(prompt)))
    while eng.has_unfinished():
        before = list(seq.draft.tokens)
        outs = eng.step()
        if len(seq.draft.tokens) == len(before) + 1:
            q = seq.draft_position - 1
            drafts.append((q, seq.token_ids + before, seq.draft.tokens[-1]))
        if outs:  # a check (or the prefill) closed a block: the position whose logits gave its last token
            heads.add(len(seq.token_ids) - 2)
    tokens = seq.token_ids
    mask = [i in heads for i in range(len(tokens) - 1)]
    with torch.no_grad():
        logits = var.forward_masked(torch.tensor([tokens[:-1]]), torch.tensor([mask]), DMTD)[0]
    checked = 0
    for q, inputs, d in drafts:
        if q not in heads and q < len(tokens) - 1 and inputs[: q + 1] == tokens[: q + 1]:
            assert int(logits[q].argmax()) == d
            checked += 1
    assert checked >= 10 and len(heads) < len(tokens) - 10  # many tails, accepted and not


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_len", [5, 140])
def test_a_checked_chunk_scores_each_position_as_that_position_alone(dtype, prompt_len):
    """A head's check over the last token and its drafts gives, at every position, the very logits a step of that
    position alone gives (bitwise in bf16): what the exact profile's equality with τ = 1 rests on, at any
    context length."""
    from dmtd.engine.config import EngineConfig

    base = base_model(5, 0.5)
    model, verifier = variant_of(base, 0.05, 6)
    model, verifier = in_dtype(model, verifier, dtype)
    eng = LLMEngine(model, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, dtype=dtype),
                    default_tau=1, eos_token_ids=[], verifier=verifier)
    rid = eng.add_request(prompts_of([prompt_len], 7)[0],
                          SamplingParams(max_new_tokens=40, tau=1, exact=True, ignore_eos=True))
    for _ in range(4):
        eng.step()
    seq, runner = eng.seqs[rid], eng.runner
    drafts, kept = [11, 42, 5], list(seq.token_ids)
    seq.draft.add(list(drafts), "probe")
    chunk = runner.verify([seq])[0]
    seq.draft.clear()
    alone = []
    for d in [*drafts, None]:
        alone.append(runner.verify([seq])[0, -1])
        if d is not None:
            seq.token_ids.append(d)
    seq.token_ids[:] = kept
    assert chunk.shape[0] == len(drafts) + 1
    assert torch.isfinite(chunk).all()
    if dtype == "bfloat16":  # the packed bf16 kernel computes every row alone: bitwise
        assert torch.equal(chunk, torch.stack(alone))
    else:  # float32 products go to torch's matmul, whose rounding may depend on the row count
        torch.testing.assert_close(chunk, torch.stack(alone), rtol=1e-5, atol=1e-4)


def test_rollback_leaves_the_cache_as_if_rejected_tokens_never_existed():
    base = base_model(2, 0.05)
    var, verifier = variant_of(base, 0.05, 2)
    eng = exact_engine(var, verifier)
    prompt = prompts_of([7], 2)[0]
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=40, tau=4, exact=True))
    seq = eng.seqs[rid]
    rejected = 0
    for _ in range(30):  # stop right after a check that rejected a draft
        m = len(seq.draft.tokens)
        outs = eng.step()
        if outs and m and outs[-1].num_accepted < m:
            rejected += 1
            if rejected == 3:
                break
    assert rejected == 3 and not seq.draft.tokens and not seq.draft.done
    n = seq.num_tokens
    assert seq.num_tail_cached <= n - 1
    fresh = tiny_engine(base, DMTD)
    fid = fresh.add_request(seq.token_ids[:-1], SamplingParams(max_new_tokens=1, tau=1))
    fresh.step()  # prefill of the committed tokens but the last (which no head has fed yet)
    fslot, slot = 0, seq.kv_row  # the fresh engine's only request took slot 0 (now free again, KV kept)
    assert fresh.seqs[fid].generated_ids == seq.token_ids[-1:]
    run_kv = eng.runner.kv[: DMTD.decoding_start] + eng.runner.cache.verify_layers
    for (k, v), (fk, fv) in zip(run_kv, fresh.runner.kv):
        torch.testing.assert_close(k[slot, :, : n - 1], fk[fslot, :, : n - 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[slot, :, : n - 1], fv[fslot, :, : n - 1], rtol=1e-4, atol=1e-5)
    # and it goes on to the base's tokens from there
    while eng.has_unfinished():
        eng.step()
    ref = tiny_engine(base, DMTD).generate([prompt], SamplingParams(max_new_tokens=40, tau=1))[0]
    assert seq.generated_ids == ref.token_ids


def _wilson_hilferty_z(chi2: float, df: int) -> float:
    return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)])
def test_sampled_exact_output_has_the_base_distribution(sampling):
    """Chi-square of the first three tokens' joint distribution against exact enumeration of the base's."""
    V, n_tok, n_runs = 5, 3, 2400
    base = base_model(4, 1.0, vocab_size=V)
    var, verifier = variant_of(base, 0.5, 4)
    prompt = [1, 3, 0, 2]
    ref = tiny_engine(base, DMTD)
    probs: dict[tuple[int, ...], float] = {}
    from dmtd.engine.sampler import filtered_probs

    sp = SamplingParams(**sampling)
    for seq in product(range(V), repeat=n_tok):
        with torch.no_grad():
            logits = ref.runner.model.forward_masked(torch.tensor([prompt + list(seq[:-1])]),
                                                     torch.ones(1, len(prompt) + n_tok - 1, dtype=torch.bool), DMTD)[0]
        p = filtered_probs(logits[len(prompt) - 1:], [sp] * n_tok)
        probs[seq] = math.prod(float(p[i, t]) for i, t in enumerate(seq))
    eng = exact_engine(var, verifier, max_num_seqs=32)
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for start in range(0, n_runs, 32):
        # one more token than counted: the prefill's token, then two drafts checked in one block
        params = [SamplingParams(max_new_tokens=n_tok + 1, tau=3, exact=True, seed=1000 + start + i,
                                 **sampling) for i in range(min(32, n_runs - start))]
        for r in eng.generate([prompt] * len(params), params):
            key = tuple(r.token_ids[:n_tok])
            counts[key] = counts.get(key, 0) + 1
            drafted, accepted = drafted + r.num_drafted, accepted + r.num_accepted
    assert 0.1 < accepted / drafted < 0.95  # both branches of the rule ran
    assert set(counts) <= {s for s, p in probs.items() if p > 0}
    cells = [s for s, p in probs.items() if p * n_runs >= 5]
    chi2 = sum((counts.get(s, 0) - probs[s] * n_runs) ** 2 / (probs[s] * n_runs) for s in cells)
    assert _wilson_hilferty_z(chi2, len(cells) - 1) < 3.5, chi2


def test_restricted_draft_vocabulary_keeps_exactness_and_must_hold_eos():
    base = base_model(5, 0.05)
    prompts = prompts_of([6, 12], 5)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=20, tau=1))
    vocab = list(range(0, 97, 2))
    got = exact_engine(base, draft_vocab=vocab).generate(
        prompts, SamplingParams(max_new_tokens=20, tau=3, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    with pytest.raises(ConfigError, match="EOS"):
        exact_engine(base, draft_vocab=vocab, eos=[3])
    with pytest.raises(ConfigError, match="distinct"):
        exact_engine(base, draft_vocab=[1, 1, 2])


def test_greedy_drafts_may_propose_context_ids_outside_the_draft_vocabulary():
    """A greedy request's drafts also score the ids of its own context (prompt and answer so far) that the draft
    vocabulary lacks: with a vocabulary holding none of the answer's tokens, only such ids can be accepted, and
    they are, once the answer repeats itself; sampled requests keep the vocabulary as it is."""
    base = base_model(3, 0.0)  # tails agree with the verifier
    prompts = prompts_of([7, 11], 3)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=40, tau=1))
    used = {t for r in ref for t in r.token_ids}
    vocab = [i for i in range(97) if i not in used]
    eng = exact_engine(base, draft_vocab=vocab)
    got = eng.generate(prompts, SamplingParams(max_new_tokens=40, tau=3, exact=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert sum(r.num_accepted for r in got) > 0 and all(t in used for r in got for t in r.token_ids)
    assert eng.runner.pass_draft_ids is not None and len(eng.runner.pass_draft_ids) > len(vocab)
    eng.generate(prompts, SamplingParams(max_new_tokens=12, tau=3, exact=True, temperature=0.8, seed=1))
    assert torch.equal(eng.runner.pass_draft_ids, eng.runner.draft_ids)  # the last pass's rows were sampled


def test_gated_tails_draw_only_from_the_draft_vocabulary_alone_or_beside_heads():
    """With a draft vocabulary, a gated tail token is always one of its ids (a step of tails alone projects
    onto them only, a step shared with heads masks the tail rows), heads keep the full vocabulary, and a
    row's tokens do not depend on what shares its steps."""
    from dmtd.engine.config import EngineConfig

    base = base_model(8, 0.2)
    prompts = prompts_of([5, 9, 14], 8)
    vocab = list(range(0, 97, 2))
    params = SamplingParams(max_new_tokens=18, tau=3, min_confidence=0.6)  # the gate splits phases

    def engine() -> LLMEngine:
        cfg = EngineConfig(max_num_seqs=8, max_model_len=256, align_phases=False)
        return LLMEngine(base, None, DMTD, cfg, default_tau=1, eos_token_ids=[], draft_vocab=vocab)

    solo = [engine().generate([p], params)[0] for p in prompts]
    heads = []
    for r in solo:
        assert len(r.head_flags) == len(r.token_ids) and not all(r.head_flags)
        assert all(t % 2 == 0 for t, head in zip(r.token_ids, r.head_flags) if not head), r.token_ids
        heads += [t for t, head in zip(r.token_ids, r.head_flags) if head]
    assert any(t % 2 for t in heads)  # heads are not restricted
    eng, steps = engine(), []
    run = eng.runner._decode_logits
    eng.runner._decode_logits = lambda h, tails, any_head: steps.append((bool(tails), any_head)) or run(
        h, tails, any_head)
    batched = eng.generate(prompts, params)
    assert (True, True) in steps and (True, False) in steps  # tails beside heads, and tails alone
    assert [r.token_ids for r in batched] == [r.token_ids for r in solo]


def test_a_dmtd_profile_request_is_the_same_after_exact_requests_switched_the_drafts_to_int8():
    """Exact requests pack the drafts' weights and head (int8 here); the unverified profile's tails keep the engine's
    own head, so its tokens and their log-probabilities are the same whether or not an exact request ran first."""
    from dmtd.engine.config import EngineConfig

    base = base_model(8, 0.2)
    prompts = prompts_of([5, 9, 14], 8)
    vocab = list(range(0, 97, 2))
    params = SamplingParams(max_new_tokens=18, tau=3, logprobs=0)

    def engine() -> LLMEngine:
        cfg = EngineConfig(max_num_seqs=8, max_model_len=256, align_phases=False, draft_quant="int8")
        return LLMEngine(base, None, DMTD, cfg, default_tau=1, eos_token_ids=[], draft_vocab=vocab)

    fresh = engine().generate(prompts, params)
    eng, steps = engine(), []
    eng.generate(prompts[:1], SamplingParams(max_new_tokens=12, tau=3, exact=True))
    assert eng.runner.draft_format == "i8dot" and eng.runner.draft_head() is not eng.runner.tail_head()
    run = eng.runner._decode_logits
    eng.runner._decode_logits = lambda h, tails, any_head: steps.append((bool(tails), any_head)) or run(
        h, tails, any_head)
    after = eng.generate(prompts, params)
    assert (True, False) in steps  # steps of tails alone, which project onto the draft vocabulary only
    assert [r.token_ids for r in after] == [r.token_ids for r in fresh]
    assert [r.logprobs for r in after] == [r.logprobs for r in fresh]


def test_exact_and_gated_rows_share_a_batch():
    base = base_model(6, 0.2)
    prompts = prompts_of([5, 8, 11], 6)
    plain = [SamplingParams(max_new_tokens=16, tau=3, min_confidence=0.4)] * 3
    solo = [tiny_engine(base, DMTD).generate([p], plain[0])[0].token_ids for p in prompts]
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=16, tau=1))
    mixed = [plain[0], SamplingParams(max_new_tokens=16, tau=3, exact=True), plain[0]]
    got = tiny_engine(base, DMTD, align_phases=False).generate(prompts, mixed)
    assert got[1].token_ids == ref[1].token_ids
    assert [got[0].token_ids, got[2].token_ids] == [solo[0], solo[2]]


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    base = base_model(7, 0.0)
    prompt = prompts_of([6], 7)[0]
    ref = tiny_engine(base, DMTD).generate([prompt], SamplingParams(max_new_tokens=20, tau=1))[0]
    stop = ref.token_ids[5]
    first = ref.token_ids.index(stop)
    got = exact_engine(base).generate([prompt], SamplingParams(max_new_tokens=20, tau=4, exact=True,
                                                               stop_token_ids=[stop]))[0]
    assert got.token_ids == ref.token_ids[: first + 1] and got.finish_reason == "stop"
