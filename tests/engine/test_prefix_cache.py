"""Prefix caching and chunked prefill: the same tokens with the cache and without it, however prompts share
prefixes, slots are evicted, and prefills are split over steps; the counters say what was reused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmtd.engine.config import EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.prefix_cache import PrefixCache, chain
from dmtd.engine.sequence import SamplingParams
from tests.engine.test_exact import DMTD, base_model, in_dtype, variant_of


def engine(seed: int, *, caching: bool, chunk: int, slots: int, dtype: str = "float32", noise: float = 0.02,
           align_phases: bool = True) -> LLMEngine:
    base = base_model(seed % 5, 0.05)
    var, verifier = in_dtype(*variant_of(base, noise, seed), dtype)
    cfg = EngineConfig(max_num_seqs=slots, max_model_len=256, dtype=dtype, prefill_chunk=chunk, page_size=4,
                       prefix_caching=caching, align_phases=align_phases)
    return LLMEngine(var, None, DMTD, cfg, default_tau=1, eos_token_ids=[], verifier=verifier)


def rand_ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=g).tolist()


def run_waves(e: LLMEngine, waves: list[list[list[int]]], params: list[SamplingParams]) -> list[list[int]]:
    """Each wave's prompts added together and run to the end; a wave's last prompt is added one step late, so
    it is admitted while the others run (chunked prefill beside decoding, copies from slots in use)."""
    out, k = [], 0
    for wave in waves:
        ids = []
        for i, p in enumerate(wave[:-1]):
            ids.append(e.add_request(p, params[k + i]))
        e.step()
        ids.append(e.add_request(wave[-1], params[k + len(wave) - 1]))
        k += len(wave)
        while e.has_unfinished():
            e.step()
        out += [e.seqs[r].token_ids for r in ids]
        for r in ids:
            e.release(r)
    return out


@settings(max_examples=14, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10_000), num_prefixes=st.integers(1, 3), prefix_len=st.integers(0, 40),
       suffixes=st.lists(st.lists(st.integers(1, 14), min_size=1, max_size=4), min_size=1, max_size=4),
       taus=st.lists(st.integers(1, 4), min_size=1, max_size=4), exact=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]), slots=st.sampled_from([2, 3, 8]),
       chunk=st.sampled_from([4, 8, 16]), max_new=st.integers(1, 16))
def test_tokens_are_the_same_with_and_without_the_prefix_cache(seed, num_prefixes, prefix_len, suffixes, taus,
                                                               exact, dtype, slots, chunk, max_new):
    """Random prompts over shared random prefixes, in waves, greedy, exact or DMTD profile with mixed τ, pools of
    2-8 slots (held chunks evicted), chunks of 4-16 positions: tokens identical with and without the cache.
    The DMTD profile runs without phase alignment: aligned, a row's heads fall where its neighbours' clock puts
    them, so its tokens follow when its prompt finished prefilling (the cache makes that sooner), not its prompt
    alone."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [rand_ids(g, prefix_len) for _ in range(num_prefixes)]
    waves, n = [], 0
    for wave in suffixes:
        waves.append([prefixes[(n + i) % num_prefixes] + rand_ids(g, s) for i, s in enumerate(wave)])
        n += len(wave)
    params = [SamplingParams(max_new_tokens=max_new, tau=taus[i % len(taus)], exact=exact) for i in range(n)]
    ref = run_waves(engine(seed, caching=False, chunk=chunk, slots=slots, dtype=dtype, align_phases=exact), waves,
                    params)
    e = engine(seed, caching=True, chunk=chunk, slots=slots, dtype=dtype, align_phases=exact)
    got = run_waves(e, waves, params)
    assert got == ref
    st_ = e.scheduler.prefix.stats
    assert st_.lookups == n and st_.cached_tokens % chunk == 0
    if n > num_prefixes and prefix_len >= chunk + 1 and slots >= n:  # (fewer slots: held chunks may be evicted)
        assert st_.hits > 0  # a later prompt starts with a whole chunk of a prefix an earlier one used
    assert e.scheduler.num_free_kv_rows == slots  # nothing held by a request after the end


def test_a_finished_prompts_chunks_and_a_running_ones_are_shared_pages():
    g = torch.Generator().manual_seed(3)
    shared = rand_ids(g, 24)
    e = engine(1, caching=True, chunk=8, slots=4)
    p = SamplingParams(max_new_tokens=6, tau=3, exact=True)
    e.generate([shared + rand_ids(g, 5)], p)  # finished: its 3 chunks stay published, their 6 pages cached
    st_ = e.scheduler.prefix.stats
    pages = e.scheduler.pages
    assert (st_.hits, st_.cached_tokens) == (0, 0) and len(pages.cached) == 6 and pages.num_used == 0
    b = e.add_request(shared + rand_ids(g, 4), p)
    e.step()  # its table starts with the cached pages: only its last 4 positions are computed
    table_b = pages.tables[e.seqs[b].kv_row]
    assert e.seqs[b].num_cached_tokens == 24 and set(table_b[:6]) == pages.cached
    c = e.add_request(shared + rand_ids(g, 7), p)
    while e.seqs[c].kv_row < 0:
        e.step()
    table_c = pages.tables[e.seqs[c].kv_row]
    assert e.seqs[c].num_cached_tokens == 24 and table_c[:6] == table_b[:6]  # b still runs: the same pages
    assert all(pages.held[q] == 2 for q in table_b[:6]) and not set(table_b[6:]) & set(table_c[6:])
    while e.has_unfinished():
        e.step()
    assert st_.hits == 2 and st_.cached_tokens == 48


def test_cached_tokens_reach_the_result_and_equal_the_base_alone():
    """The exact profile with the cache gives the verifier's own tokens (the base model alone, no cache)."""
    g = torch.Generator().manual_seed(5)
    shared = rand_ids(g, 33)
    prompts = [shared + rand_ids(g, n) for n in (3, 9, 1)]
    base = base_model(2, 0.05)
    alone = LLMEngine(base, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, prefill_chunk=8,
                                                     prefix_caching=False), default_tau=1, eos_token_ids=[])
    ref = [alone.generate([p], SamplingParams(max_new_tokens=12))[0].token_ids for p in prompts]
    var, verifier = variant_of(base, 0.02, 2)
    e = LLMEngine(var, None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=256, prefill_chunk=8),
                  default_tau=1, eos_token_ids=[], verifier=verifier)
    got = [e.generate([p], SamplingParams(max_new_tokens=12, tau=4, exact=True))[0].token_ids
           for p in prompts]
    assert got == ref
    assert e.scheduler.prefix.stats.cached_tokens == 2 * 32


def test_a_long_prompt_is_prefilled_a_chunk_a_step_beside_running_rows():
    g = torch.Generator().manual_seed(7)
    e = engine(4, caching=False, chunk=8, slots=4)
    p = SamplingParams(max_new_tokens=40, tau=2)
    e.add_request(rand_ids(g, 5), p)
    e.step()  # prefilled: it runs
    steps: list[str] = []
    prefill, decode = e.runner.prefill, e.executor._decode

    def traced_prefill(seqs):
        steps.append(f"P{sum(s.prefill_end - s.num_prefilled for s in seqs)}")
        return prefill(seqs)

    def traced_decode(out, t):
        steps.append("D")
        return decode(out, t)

    e.runner.prefill, e.executor._decode = traced_prefill, traced_decode
    long = e.add_request(rand_ids(g, 60), p)
    while e.seqs[long].num_prefilled < 60:
        e.step()
    # 60 positions: 7 chunks of 8 and one of 4; the first at once, each later one after a decode step
    assert steps == ["P8", "D"] * 7 + ["P4"]
    e.runner.prefill, e.executor._decode = prefill, decode
    while e.has_unfinished():
        e.step()
    assert len(e.seqs[long].token_ids) == 60 + 40


def test_aborted_mid_prefill_frees_its_slot():
    g = torch.Generator().manual_seed(9)
    e = engine(6, caching=True, chunk=8, slots=2)
    p = SamplingParams(max_new_tokens=30)
    e.add_request(rand_ids(g, 3), p)
    e.step()
    long = e.add_request(rand_ids(g, 50), p)
    e.step()  # the long prompt's first chunk
    assert e.seqs[long].num_prefilled == 8 and e.scheduler.num_free_kv_rows == 0
    assert e.abort(long)
    assert e.scheduler.num_free_kv_rows == 1 and not e.scheduler.prefilling
    while e.has_unfinished():
        e.step()
    assert e.scheduler.num_free_kv_rows == 2


def test_the_chain_and_the_index():
    keys = chain(list(range(20)), 8, "1:0")
    assert len(keys) == 2 and keys == chain(list(range(16)) + [99] * 4, 8, "1:0")
    assert chain(list(range(20)), 8, "0:0")[0] != keys[0]  # the salt: exact or not, τ where it matters
    assert chain([1] + list(range(1, 20)), 8, "1:0")[1] != keys[1]  # a chunk's key covers all before it
    pc = PrefixCache(8)
    assert pc.publish(keys, [5, 6, 1, 2]) == [5, 6, 1, 2]  # two chunks of two pages
    assert pc.publish(keys[:1], [7, 8]) == []  # published already: it keeps its pages
    assert pc.lookup(keys) == (2, [5, 6, 1, 2]) and pc.lookup(keys[:1]) == (1, [5, 6]) and pc.lookup([b"x"]) == (0, [])
    held = [0] * 9
    held[5] = 1  # a row holds the first chunk's first page: only the second chunk can go
    assert pc.evict(held) == [1, 2] and pc.evict(held) == [] and pc.stats.evicted_chunks == 1
    assert pc.lookup(keys) == (1, [5, 6])
    held[5] = 0
    assert pc.evict(held) == [5, 6] and pc.num_cached_chunks == 0


@pytest.mark.parametrize("chunk", [0, -1])
def test_a_chunk_length_below_one_is_refused(chunk):
    from dmtd.engine.config import ConfigError

    with pytest.raises(ConfigError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=chunk)


def test_prompts_arriving_together_share_the_first_ones_chunks():
    """Admitted in the same step, the later prompts read the chunks the first one computed just before them."""
    g = torch.Generator().manual_seed(11)
    shared = rand_ids(g, 40)
    prompts = [shared + rand_ids(g, n) for n in (2, 5, 9)]
    p = SamplingParams(max_new_tokens=8, tau=3, exact=True)
    ref = engine(8, caching=False, chunk=8, slots=4).generate(prompts, p)
    e = engine(8, caching=True, chunk=8, slots=4)
    got = e.generate(prompts, p)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    st_ = e.scheduler.prefix.stats
    assert st_.hits == 2 and st_.cached_tokens == 2 * 40


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm2_long_shared_prompts_batched_and_cached_give_the_base_models_tokens(dtype):
    """SmolLM2, a ~430-token system prompt shared by 4 chats: the prompts as rows of one call (bf16: packed weights)
    or in chunks through SDPA (float32), prefilled together and from the prefix cache; the exact profile's tokens
    are the base model's, each prompt alone and without the cache."""
    from dmtd.bench.exact_bench import CHATS
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    prec = getattr(torch, dtype)
    system = " ".join(f"Guideline {i}: keep answers short, kind and correct about item {i}." for i in range(30))
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": c}] for c in CHATS[:4]]
    base = build_engine(engine_spec(None, "none", dtype=prec),
                        EngineConfig(max_num_seqs=2, max_model_len=1024, dtype=dtype, prefix_caching=False))
    assert len(base.encode(prompts[0])) > 3 * 128  # three whole chunks to share
    ref = [base.generate([p], SamplingParams(max_new_tokens=16))[0].token_ids for p in prompts]
    e = build_engine(engine_spec(None, "smollm2-135m-dmtd", dtype=prec, search_dirs=[SHIPPED_VARIANTS]),
                     EngineConfig(max_num_seqs=4, max_model_len=1024, dtype=dtype, adaptive_drafts=True))
    assert e.runner.prefill_runner.rows_ok() == (dtype == "bfloat16")  # packed weights: rows in one call
    exact = SamplingParams(max_new_tokens=16, tau=3, exact=True)
    together = [r.token_ids for r in e.generate(prompts, exact)]
    again = [r.token_ids for r in e.generate(prompts[::-1], exact)][::-1]  # from the cache, in another order
    assert together == ref and again == ref
    assert e.scheduler.prefix.stats.cached_tokens >= 7 * 384


def test_a_finished_answer_is_published_only_where_the_engine_vouches_for_it():
    """A finished sequence's whole chunks of prompt and answer are published when the engine says its generated KV
    is a prefill's (``answers``); without that only the prompt's are; the last token's KV (never computed) is not."""
    g = torch.Generator().manual_seed(11)
    prompt = rand_ids(g, 10)
    for vouch in (False, True):
        e = engine(3, caching=True, chunk=4, slots=2)
        e.scheduler.kv.answers = (lambda s: True) if vouch else None
        r = e.generate([prompt], SamplingParams(max_new_tokens=9, exact=True))[0]
        seq_tokens = prompt + r.token_ids  # 19 tokens: 18 computed, the last never fed
        st_ = e.scheduler.prefix.stats
        st_.cached_tokens = 0
        e.generate([seq_tokens + rand_ids(g, 3)], SamplingParams(max_new_tokens=2, exact=True))
        assert st_.cached_tokens == (16 if vouch else 8)


def test_smollm2_a_second_turn_reads_the_first_answer_and_gets_the_base_models_tokens():
    """SmolLM2 in bf16, the exact profile (the served default): turn 1's answer is published as it finishes, so
    turn 2 (turn 1's prompt, its answer, a new message) prefills only what is new — and its tokens are still the
    base model's, computed alone without any cache."""
    from dmtd.bench.exact_bench import CHATS
    from dmtd.engine import lowbit
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    base = build_engine(engine_spec(None, "none", dtype=torch.bfloat16),
                        EngineConfig(max_num_seqs=2, max_model_len=1024, dtype="bfloat16", prefix_caching=False))
    e = build_engine(engine_spec(None, "smollm2-135m-dmtd", dtype=torch.bfloat16, search_dirs=[SHIPPED_VARIANTS]),
                     EngineConfig(max_num_seqs=4, max_model_len=1024, dtype="bfloat16", adaptive_drafts=True))
    exact = SamplingParams(max_new_tokens=40, exact=True)
    publishes = e.scheduler.kv.answers is not None
    assert publishes == (lowbit.loaded_path() != "amx")
    for chat in CHATS[:2]:
        turn1 = e.encode([{"role": "user", "content": chat}])
        answer = e.generate([turn1], exact)[0].token_ids
        turn2 = turn1 + answer + e.encode("\nThanks! Now say it again, shorter.")
        before = e.scheduler.prefix.stats.cached_tokens
        got = e.generate([turn2], exact)[0].token_ids
        cached = e.scheduler.prefix.stats.cached_tokens - before
        ref = base.generate([turn2], SamplingParams(max_new_tokens=40))[0].token_ids
        assert got == ref
        if publishes:  # every whole page of turn 1's prompt and answer but the answer's last token
            assert cached == (len(turn1) + len(answer) - 1) // 16 * 16
