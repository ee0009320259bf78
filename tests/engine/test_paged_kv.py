"""The paged KV cache: sequences hold pages of one pool, the newest is preempted when the pool runs dry and goes on
where it was, a request that can never fit is refused at admission; tokens are the same whatever the pool's size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmtd.engine.config import ConfigError, EngineConfig
from dmtd.engine.kv_pages import KVPages
from dmtd.engine.llm import LLMEngine
from dmtd.engine.scheduler import CapacityError
from dmtd.engine.sequence import SamplingParams
from tests.engine.test_exact import DMTD, base_model, in_dtype, variant_of
from tests.engine.test_prefix_cache import rand_ids, run_waves


def test_pages_are_handed_out_and_taken_back():
    p = KVPages(num_pages=6, page_size=4, num_rows=3)
    assert p.grow(0, 9) and p.tables[0] == [0, 1, 2]  # positions 0 .. 8: three pages, the lowest first
    assert p.grow(0, 12) and p.tables[0] == [0, 1, 2]  # already held
    assert p.grow(1, 4) and p.tables[1] == [3]
    assert not p.grow(2, 12) and p.tables[2] == []  # three more pages than the two free: none taken
    p.shrink(0, 5)  # keeps positions 0 .. 4: two pages
    assert p.tables[0] == [0, 1] and p.num_free == 3
    assert p.grow(2, 12) and p.tables[2] == [2, 4, 5]
    assert p.peak_used == 6 and p.take_dirty() == [0, 1, 2] and p.take_dirty() == []
    for row in range(3):
        p.shrink(row, 0)
    assert p.num_free == 6 and p.report()["kv_utilisation"] == 0.0


def engine(seed: int, *, pool: int | None, slots: int, dtype: str, align_phases: bool, chunk: int = 8,
           noise: float = 0.02) -> LLMEngine:
    base = base_model(seed % 5, 0.05)
    var, verifier = in_dtype(*variant_of(base, noise, seed), dtype)
    cfg = EngineConfig(max_num_seqs=slots, max_model_len=128, dtype=dtype, prefill_chunk=chunk, page_size=4,
                       kv_cache_tokens=pool, align_phases=align_phases)
    return LLMEngine(var, None, DMTD, cfg, default_tau=1, eos_token_ids=[], verifier=verifier)


@settings(max_examples=14, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10_000), prefix_len=st.integers(0, 24),
       suffixes=st.lists(st.lists(st.integers(1, 12), min_size=2, max_size=5), min_size=1, max_size=3),
       taus=st.lists(st.integers(1, 4), min_size=1, max_size=4), exact=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]), pool=st.sampled_from([64, 72, 96]),
       max_new=st.integers(4, 20))
def test_tokens_are_the_same_whatever_the_pool_and_however_often_sequences_are_preempted(
        seed, prefix_len, suffixes, taus, exact, dtype, pool, max_new):
    """Waves of random prompts over a shared random prefix, greedy, exact or DMTD profile with mixed τ, on pools of
    16-24 pages of 4 positions (the longest request fits; sequences preempted, cached prompts dropped) against a
    pool with room for every sequence: identical tokens. As in the prefix-cache test, the DMTD profile runs without
    phase alignment (aligned, a row's heads follow the clock of whatever ran beside it)."""
    g = torch.Generator().manual_seed(seed)
    prefix = rand_ids(g, prefix_len)
    waves = [[prefix + rand_ids(g, s) for s in wave] for wave in suffixes]
    n = sum(len(w) for w in waves)
    params = [SamplingParams(max_new_tokens=max_new, tau=taus[i % len(taus)], exact=exact) for i in range(n)]
    ref = run_waves(engine(seed, pool=None, slots=5, dtype=dtype, align_phases=exact), waves, params)
    e = engine(seed, pool=pool, slots=5, dtype=dtype, align_phases=exact)
    got = run_waves(e, waves, params)
    assert got == ref
    sch = e.scheduler
    assert sch.pages.peak_used <= sch.pages.num_pages
    assert not sch.running and not sch.waiting and sch.num_free_kv_rows == 5
    assert sch.pages.num_used == 0  # no row holds a page: what is not free is cached prompts
    assert sch.pages.num_evictable == len(sch.pages.cached) == sch.pages.num_pages - sch.pages.num_free


@pytest.mark.parametrize("exact", [True, False])
def test_a_dry_pool_preempts_the_newest_and_it_goes_on_where_it_was(exact):
    """Four sequences whose answers outgrow a pool of 20 pages: the newest are preempted (their pages freed), queued
    first, prefilled again over their tokens so far, and every sequence ends with the tokens it gets alone."""
    g = torch.Generator().manual_seed(11)
    prompts = [rand_ids(g, 9 + 2 * i) for i in range(4)]
    params = SamplingParams(max_new_tokens=40, tau=3, exact=exact)
    alone = [engine(4, pool=None, slots=1, dtype="float32", align_phases=False).generate([p], params)[0].token_ids
             for p in prompts]
    e = engine(4, pool=80, slots=4, dtype="float32", align_phases=False)
    got = [r.token_ids for r in e.generate(prompts, params)]
    assert e.scheduler.num_preempted >= 1
    assert got == alone
    assert e.scheduler.pages.num_used == 0


@pytest.mark.parametrize("exact", [True, False])
def test_a_prompt_preempted_before_its_first_token_starts_over(exact):
    """A long prompt prefilled in chunks between a running sequence's decode steps is preempted part way (the pool
    runs dry as the other grows): it is queued again as a new prompt — prefilled whole, its first token sampled — not
    resumed as a sequence that had tokens (a resume feeds its last token as a decode step: from a prompt that would
    be a tail with no head before it). Both end with the tokens they get alone."""
    g = torch.Generator().manual_seed(5)
    short, long = rand_ids(g, 6), rand_ids(g, 56)
    params = [SamplingParams(max_new_tokens=40, tau=3, exact=exact), SamplingParams(max_new_tokens=8, tau=3,
                                                                                      exact=exact)]
    alone = [engine(4, pool=None, slots=1, dtype="float32", align_phases=False).generate([p], q)[0].token_ids
             for p, q in zip((short, long), params)]
    e = engine(4, pool=80, slots=2, dtype="float32", align_phases=False, chunk=4)  # 20 pages of 4
    a = e.add_request(short, params[0])
    while e.seqs[a].num_tokens < 12:  # the short one decodes a while: its pages grow toward the pool's end
        e.step()
    b = e.add_request(long, params[1])
    preempted_early = False
    while e.has_unfinished():
        e.step()
        seq = e.seqs[b]
        preempted_early |= seq.num_preempted > 0 and seq.num_generated == 0
    assert preempted_early  # caught part way through its prompt
    assert [e.seqs[r].token_ids[e.seqs[r].prompt_len:] for r in (a, b)] == alone
    assert e.scheduler.pages.num_used == 0


def test_a_request_that_can_never_fit_is_refused_at_admission_and_others_run():
    e = engine(2, pool=32, slots=2, dtype="float32", align_phases=True)
    with pytest.raises(CapacityError, match="prompt: 40 tokens need more than the KV pool's 8 pages of 4"):
        e.add_request(list(range(1, 41)), SamplingParams(max_new_tokens=2))
    with pytest.raises(CapacityError, match="max_new_tokens: 10 prompt tokens and 30 new ones need more"):
        e.add_request(list(range(1, 11)), SamplingParams(max_new_tokens=30))
    assert not e.seqs and not e.scheduler.waiting  # nothing half-added
    out = e.generate([list(range(1, 11))], SamplingParams(max_new_tokens=8))[0]
    assert len(out.token_ids) == 8 and e.scheduler.pages.num_used == 0
    assert len(e.scheduler.pages.cached) == 2  # its prompt's whole chunk stays cached (8 positions, 2 pages)


def test_the_pool_is_sized_by_memory_or_positions():
    base = base_model(0, 0.05)
    var, verifier = variant_of(base, 0.02, 0)
    by_tokens = LLMEngine(var, None, DMTD, EngineConfig(max_num_seqs=64, max_model_len=8192, kv_cache_tokens=4096),
                          verifier=verifier)
    assert by_tokens.scheduler.pages.num_pages == 4096 // 16 and by_tokens.runner.cache.table.shape == (64, 512)
    from dmtd.engine.kv_cache import bytes_per_position

    per = bytes_per_position(var.config, DMTD, torch.float32, torch.float32)
    cfg = EngineConfig(max_num_seqs=4, max_model_len=512, kv_cache_gib=per * 16 * 10 / 2**30)
    by_mem = LLMEngine(var, None, DMTD, cfg, verifier=verifier)
    assert by_mem.scheduler.pages.num_pages == 10
    by_mem.runner.enable_exact()
    cache = by_mem.runner.cache
    assert cache.nbytes <= per * 16 * 10 + cache.tail_enc.nbytes + cache.table.nbytes
    with pytest.raises(ConfigError, match="kv_cache_tokens must be at least one page"):
        EngineConfig(kv_cache_tokens=8)
    with pytest.raises(ConfigError, match="holds no page"):
        LLMEngine(var, None, DMTD, EngineConfig(kv_cache_gib=1e-9), verifier=verifier)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm2_preempted_exact_requests_are_the_base_models_tokens(dtype):
    """SmolLM2 and the shipped variant, 6 chats on a pool too small for all their answers: sequences are preempted
    and resumed, and the exact profile's tokens are the base model's, each chat alone."""
    from dmtd.bench.exact_bench import CHATS
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    prec = getattr(torch, dtype)
    prompts = [[{"role": "user", "content": c}] for c in CHATS[:6]]
    base = build_engine(engine_spec(None, "none", dtype=prec), EngineConfig(max_num_seqs=1, max_model_len=512,
                                                                            dtype=dtype))
    ref = [base.generate([p], SamplingParams(max_new_tokens=40))[0].token_ids for p in prompts]
    e = build_engine(engine_spec(None, "smollm2-135m-dmtd", dtype=prec, search_dirs=[SHIPPED_VARIANTS]),
                     EngineConfig(max_num_seqs=6, max_model_len=512, dtype=dtype, adaptive_drafts=True,
                                  kv_cache_tokens=320))
    got = [r.token_ids for r in e.generate(prompts, SamplingParams(max_new_tokens=40, tau=3, exact=True))]
    assert e.scheduler.num_preempted >= 1
    assert got == ref
