"""The exact profile on the shipped variant: its greedy tokens are the base model's, on real chat prompts."""

from __future__ import annotations

import pytest

from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.paths import SHIPPED_VARIANTS

CHATS = [
    "Explain in three sentences why the sky is blue.", "Write a haiku about autumn.",
    "What is the capital of France?", "List three fruits and their colours.", "How do bees make honey?",
    "Give me two tips for better sleep.", "What is 17 times 3? Explain your steps.", "Describe a cat to a child.",
    "Write a Python function that reverses a string.", "Why is exercise good for you?",
    "Summarise the plot of Cinderella in two sentences.", "What causes rain?", "Name three planets.",
    "Translate 'good morning' into French and Spanish.", "What is photosynthesis?",
    "Write a short poem about the sea.", "How does a bicycle stay upright?", "What is a prime number?",
    "Suggest a name for a pet goldfish and say why.", "Explain what a computer program is.",
]


@pytest.fixture(scope="module")
def engines():
    spec = engine_spec(None, "smollm2-135m-dmtd", search_dirs=[SHIPPED_VARIANTS])
    variant = build_engine(spec, EngineConfig(max_num_seqs=10, max_model_len=512))
    base = build_engine(engine_spec(None, "none"), EngineConfig(max_num_seqs=10, max_model_len=512))
    return variant, base


@pytest.mark.parametrize("tau,threshold", [(3, 0.0), (4, 0.5)])
def test_exact_greedy_tokens_equal_the_base_at_tau1_on_20_chat_prompts(engines, tau, threshold):
    variant, base = engines
    assert variant.verifier_name == "base"
    prompts = [[{"role": "user", "content": c}] for c in CHATS]
    ref = base.generate(prompts, SamplingParams(max_new_tokens=40, tau=1))
    got = variant.generate(prompts, SamplingParams(max_new_tokens=40, tau=tau, exact=True,
                                                   min_confidence=threshold))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    drafted, accepted = sum(r.num_drafted for r in got), sum(r.num_accepted for r in got)
    assert drafted > 100 and 0.15 < accepted / drafted < 0.95  # real drafting, real rejections
    # the variant's own τ = 1 path (its adapted decoding layers at every head) is not the base: exactness
    # comes from the verifier, not from a variant that happens to agree
    own = variant.generate(prompts[:6], SamplingParams(max_new_tokens=40, tau=1))
    assert [r.token_ids for r in own] != [r.token_ids for r in ref[:6]]


def test_manifest_verifier_must_match_what_the_tensors_make(tmp_path):
    import json
    import shutil

    from dmtd.variants.manifest import ManifestError

    root = tmp_path / "v"
    shutil.copytree(SHIPPED_VARIANTS / "smollm2-135m-dmtd", root)
    data = json.loads((root / "variant.json").read_text())
    assert data["verifier"] == "base"
    data["verifier"] = "variant"
    (root / "variant.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="verifier is 'variant' in the manifest"):
        engine_spec(None, str(root))


def test_a_stop_string_inside_accepted_drafts_ends_the_block_with_what_was_emitted(engines):
    """Tokens counted are tokens streamed: the block holds the emitted tokens, accepted counts only those."""
    variant, _ = engines
    prompt = [{"role": "user", "content": CHATS[0]}]
    params = SamplingParams(max_new_tokens=48, tau=4, exact=True)
    outs = list(variant.stream(prompt, params))
    ends = [i for i, o in enumerate(outs) if o.block and len(o.block) >= 3 and o.num_accepted >= 2]
    assert ends, "no cycle accepted two drafts on this prompt"
    start = ends[0] - len(outs[ends[0]].block) + 1  # the block's first token, an accepted draft; so is the next
    text = "".join(o.text_delta for o in outs)
    before = "".join(o.text_delta for o in outs[: start + 1])
    stop = outs[start + 1].text_delta  # the second draft's text, first seen there
    assert stop.strip() and text.find(stop) == len(before)
    r = variant.generate([prompt], SamplingParams(max_new_tokens=48, tau=4, exact=True, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.text == before
    assert r.token_ids == [o.token_id for o in outs[: start + 2]]
    assert [t for b in r.blocks for t in b] == r.token_ids and r.blocks[-1] == r.token_ids[-2:]
    assert r.num_accepted + sum(r.head_flags) == len(r.token_ids)  # every token: an accepted draft or a head's
    assert sum(r.accepted_by_pos) == r.num_accepted and r.accepted_by_pos[:2] <= r.drafted_by_pos[:2]
    last = [o for o in variant.stream(prompt, SamplingParams(max_new_tokens=48, tau=4, exact=True,
                                                             stop=[stop]))][-1]
    assert last.finished and last.block == r.token_ids[-2:] and last.num_accepted == 2


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "bfloat16")],
                         ids=["float32", "bfloat16", "bfloat16-kv-bf16"])
def test_exact_tokens_are_the_base_models_alone_and_in_a_batch_of_16_mixed_requests(dtype, kv):
    """The base model (``--variant none``) is the reference, alone and in batches of 16 (the same tokens: its rows
    are computed alone whatever shares the step); the exact profile at the same precision gives its tokens alone
    and inside batches of 16 that mix τ, draft stops, the dmtd profile and sampled requests — with a bfloat16 KV
    cache too (kv_cache_dtype, where the CPU path has one), the base's own tokens at that cache."""
    import torch

    from dmtd.engine import lowbit
    from dmtd.engine.runner import attend_kernel_on

    if kv == "bfloat16" and (not attend_kernel_on() or lowbit.loaded_path() == "amx"):
        pytest.skip(f"no bfloat16 KV cache on this kernel path ({lowbit.loaded_path()}): it keeps float32")
    prec = getattr(torch, dtype)
    cfg = EngineConfig(max_num_seqs=16, max_model_len=512, dtype=dtype, kv_cache_dtype=kv)
    base = build_engine(engine_spec(None, "none", dtype=prec), cfg)
    variant = build_engine(engine_spec(None, "smollm2-135m-dmtd", dtype=prec, search_dirs=[SHIPPED_VARIANTS]), cfg)
    prompts = [[{"role": "user", "content": c}] for c in CHATS]
    greedy = SamplingParams(max_new_tokens=24, tau=1)
    ref = [r.token_ids for r in base.generate(prompts, greedy)]  # 20 requests: batches of 16, then 4
    for i in (0, 7, 13):
        assert base.generate([prompts[i]], greedy)[0].token_ids == ref[i], f"base, prompt {i} alone"
        alone = variant.generate([prompts[i]], SamplingParams(max_new_tokens=24, tau=3, exact=True))[0]
        assert alone.token_ids == ref[i], f"exact, prompt {i} alone"
    exact = [SamplingParams(max_new_tokens=24, tau=2 + i % 3, exact=True, min_confidence=(0.0, 0.5)[i % 2])
             for i in range(len(prompts))]
    others = [SamplingParams(max_new_tokens=16, tau=3),  # the dmtd profile: unverified tails
              SamplingParams(max_new_tokens=16, tau=3, exact=True, temperature=0.8, seed=1),
              SamplingParams(max_new_tokens=16, tau=1, temperature=1.0, seed=2)]
    batch = [(p, q) for p, q in zip(prompts, exact)]
    for j, q in enumerate(others * 2):  # companions spread through the batch
        batch.insert(3 * j + 1, (prompts[(5 * j) % len(prompts)], q))
    got = variant.generate([p for p, _ in batch], [q for _, q in batch])
    mine = [r.token_ids for r, (_, q) in zip(got, batch) if q.exact and q.temperature == 0]
    assert len(mine) == len(ref) and mine == ref
    assert sum(r.num_accepted for r in got) > 0  # drafts were accepted, not only the verifier's own tokens


def arrivals_against_unaligned(engines, prompts, groups, tau, new_tokens, arrive):
    """Run ``prompts`` as exact requests at ``tau`` on the aligned engine and on one with ``align_checks`` off, the
    groups of prompts (sizes ``groups``) added as ``arrive(engine, ids)`` lets them; every request's tokens must
    be the base model's. Returns the check passes each engine ran."""
    variant, base = engines
    ref = [r.token_ids for r in base.generate(prompts, SamplingParams(max_new_tokens=new_tokens, tau=1))]
    apart = build_engine(engine_spec(None, "smollm2-135m-dmtd", search_dirs=[SHIPPED_VARIANTS]),
                         EngineConfig(max_num_seqs=10, max_model_len=512, align_checks=False))
    checks = {}
    for name, e in (("aligned", variant), ("apart", apart)):
        e.pass_stats.clear()
        params = SamplingParams(max_new_tokens=new_tokens, tau=tau, exact=True, ignore_eos=True)
        ids: list[str] = []
        at = 0
        for n in groups:
            new = [e.add_request(e.encode(p), params) for p in prompts[at: at + n]]
            at += n
            arrive(e, new)
            ids += new
        while e.has_unfinished():
            e.step()
        got = [e.seqs[r].token_ids[e.seqs[r].prompt_len:] for r in ids]
        assert [g[: len(t)] for g, t in zip(got, ref)] == ref, name
        checks[name] = e.pass_stats["verify"][0]
        for r in ids:
            e.release(r)
    assert apart.num_joined_checks == 0
    return checks


def test_rows_that_arrive_apart_check_together_and_keep_the_base_models_tokens(engines):
    """Exact requests added a step apart start their cycles out of phase; with ``align_checks`` (the default) the
    rows still drafting join the check most rows make, so the batch runs fewer check passes than rows each checking
    when due — and every request's tokens are the base model's either way."""
    joined = engines[0].num_joined_checks
    prompts = [[{"role": "user", "content": c}] for c in CHATS[:4]]
    checks = arrivals_against_unaligned(engines, prompts, [1, 1, 1, 1], 4, 24, lambda e, ids: e.step())
    assert engines[0].num_joined_checks > joined
    assert checks["aligned"] < checks["apart"]


def test_rows_spread_evenly_over_a_cycles_phases_come_into_phase(engines):
    """Six exact requests at τ = 3 added so that two start each phase of a cycle: no step has half the rows checking,
    and before the plurality rule each step ran a draft pass and a check pass for the whole run. Now the rows
    still drafting join the largest group's check, the run needs fewer check passes than with ``align_checks``
    off, and every request's tokens are still the base model's."""

    def decode_then_one_more(e, ids):  # the group's first tokens, then a decode step before the next group
        while any(len(e.seqs[r].token_ids) <= e.seqs[r].prompt_len for r in ids):
            e.step()
        e.step()

    prompts = [[{"role": "user", "content": c}] for c in CHATS[:6]]
    checks = arrivals_against_unaligned(engines, prompts, [2, 2, 2], 3, 30, decode_then_one_more)
    assert checks["aligned"] < 0.6 * checks["apart"]  # measured: 23 against 57 (every step one check apart)
