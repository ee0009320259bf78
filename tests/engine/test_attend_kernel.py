"""dmtd::attend (kernels/attend.h, kernels/attend_amx.h): decode rows' and prompt rows' attention over the paged
float32 (or bfloat16) KV cache — what it computes, and that a row's bits do not depend on what shares its call."""

from __future__ import annotations

import pytest
import torch

from dmtd.engine import lowbit
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_model


@pytest.fixture(scope="module", autouse=True)
def kernels():
    lowbit.load_kernels()  # compiled once per CPU and torch version, cached under $DMTD_CACHE/kernels


def _attention_reference(q, kc, vc, slots, lens):
    """Softmax attention of each row over keys 0 .. len − 1 of its slot, GQA, in float64."""
    B, nh, hd = q.shape
    g = nh // kc.shape[1]
    out = torch.empty(B, nh, hd, dtype=torch.float64)
    for b in range(B):
        k = kc[slots[b], :, : lens[b]].double().repeat_interleave(g, 0)  # [nh, n, hd]
        v = vc[slots[b], :, : lens[b]].double().repeat_interleave(g, 0)
        w = torch.softmax((k @ q[b].double().unsqueeze(-1)).squeeze(-1) * hd ** -0.5, -1)  # [nh, n]
        out[b] = (w.unsqueeze(-1) * v).sum(1)
    return out.reshape(B, nh * hd)


def _paged(cache, page_size, gen):
    """A contiguous cache [seqs, nkv, maxlen, hd] laid out in pages [pages, nkv, P, hd] in a shuffled order, and the
    page table [seqs, maxlen / P] that reads it back."""
    S, nkv, maxlen, hd = cache.shape
    n = maxlen // page_size
    order = torch.randperm(S * n, generator=gen)
    pages = torch.empty(S * n, nkv, page_size, hd)
    table = order.view(S, n)
    for s in range(S):
        for j in range(n):
            pages[table[s, j]] = cache[s, :, j * page_size: (j + 1) * page_size]
    return pages, table


@pytest.mark.parametrize("hd", [64, 128, 32, 24])  # the AVX-512 groups (C = 4, 8, 2) and the plain loops
def test_a_bfloat16_cache_gives_the_bits_of_a_float32_cache_holding_its_values(hd):
    """kv_cache_dtype bfloat16: the kernel widens each stored key and value exactly and runs the float32 cache's
    arithmetic, so a bf16 cache's attention is bitwise the float32 cache's over the same (rounded) values — alone,
    in groups of a sequence's rows and in scattered pages."""
    if lowbit.loaded_path() == "amx":
        with pytest.raises(RuntimeError, match="amx path keeps its KV cache in float32"):
            z = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
            torch.ops.dmtd.attend(torch.zeros(1, 1, 64), z, z, torch.zeros(1, 1, dtype=torch.long),
                                  torch.tensor([0]), torch.tensor([1]), 1.0)
        return
    torch.manual_seed(11)
    nh, nkv, slots_n, maxlen = 6, 2, 3, 96
    k16 = torch.randn(slots_n, nkv, maxlen, hd).bfloat16()
    v16 = torch.randn(slots_n, nkv, maxlen, hd).bfloat16()
    slots = torch.tensor([1, 1, 1, 0, 2, 2])  # three rows of one sequence (a check's positions), then others
    lens = torch.tensor([40, 41, 42, 1, 96, 17])
    q = torch.randn(6, nh, hd)
    gen = torch.Generator().manual_seed(5)
    kp, table = _paged(k16.float(), 16, gen)
    vp = torch.empty_like(kp)
    vp[table.flatten()] = v16.float().view(slots_n, nkv, maxlen // 16, 16, hd).transpose(1, 2).reshape(-1, nkv, 16, hd)
    want = torch.ops.dmtd.attend(q, kp, vp, table, slots, lens, hd ** -0.5)
    got = torch.ops.dmtd.attend(q, kp.bfloat16(), vp.bfloat16(), table, slots, lens, hd ** -0.5)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), _attention_reference(q, k16.float(), v16.float(), slots, lens),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.dmtd.attend(q[:1], kp.bfloat16(), vp, table, slots[:1], lens[:1], 1.0)  # mixed K/V dtypes


@pytest.mark.parametrize("hd", [64, 24])  # AVX-512 path (a multiple of 16) and the plain loops
def test_attend_is_softmax_attention_and_a_row_gets_the_same_bits_alone_beside_others_and_in_pages(hd):
    """dmtd::attend (kernels/attend.h): every decode row's attention over its own sequence's first ``len`` keys, one
    call a layer. A row's value is bitwise the same whatever else shares the call — the exact profile's check of a
    chunk of positions rests on it — and whether its keys sit in one run or in pages of 16 scattered over the pool;
    every length from 1 to past one AVX-512 block is right."""
    torch.manual_seed(3)
    nh, nkv, slots_n, maxlen = 9, 3, 4, 80
    kc, vc = torch.randn(slots_n, nkv, maxlen, hd), torch.randn(slots_n, nkv, maxlen, hd)
    whole = torch.arange(slots_n)[:, None]  # one page of maxlen positions per sequence: a contiguous cache
    slots = torch.tensor([2, 0, 2, 3, 1, 2])
    lens = torch.tensor([1, 17, 33, 16, 80, 34])
    q = torch.randn(6, nh, hd, dtype=torch.bfloat16)  # any float dtype in; float32 out
    together = torch.ops.dmtd.attend(q, kc, vc, whole, slots, lens, hd ** -0.5)
    assert together.dtype == torch.float32 and together.shape == (6, nh * hd)
    torch.testing.assert_close(together.double(), _attention_reference(q.float(), kc, vc, slots, lens),
                               rtol=1e-5, atol=1e-5)
    for i in range(6):
        alone = torch.ops.dmtd.attend(q[i: i + 1], kc, vc, whole, slots[i: i + 1], lens[i: i + 1], hd ** -0.5)
        assert torch.equal(alone[0], together[i])
    gen = torch.Generator().manual_seed(7)
    kp, table = _paged(kc, 16, gen)
    vp = torch.empty_like(kp)
    vp[table.flatten()] = vc.view(slots_n, nkv, maxlen // 16, 16, hd).transpose(1, 2).reshape(-1, nkv, 16, hd)
    assert torch.equal(torch.ops.dmtd.attend(q, kp, vp, table, slots, lens, hd ** -0.5), together)
    with pytest.raises(RuntimeError, match="sequence or length out of range"):
        torch.ops.dmtd.attend(q[:1], kc, vc, whole, torch.tensor([0]), torch.tensor([maxlen + 1]), 1.0)
    with pytest.raises(RuntimeError, match="not in the pool"):
        torch.ops.dmtd.attend(q[:1], kp, vp, table.clamp(max=0) + kp.shape[0], torch.tensor([0]), torch.tensor([3]),
                              1.0)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        torch.ops.dmtd.attend(q[:1], kc.double(), vc.double(), whole, torch.tensor([0]), torch.tensor([3]), 1.0)


@pytest.mark.parametrize(("nh", "nkv", "hd"), [(9, 3, 64), (8, 1, 32), (4, 1, 128), (6, 6, 64), (8, 2, 64)])
def test_attend_groups_of_a_sequences_rows_and_heads_give_each_row_its_bits_alone(nh, nkv, hd):
    """Rows that are consecutive positions of one sequence (a prompt's, a check's) and the query heads sharing a KV
    head run as groups that load each key once (kernels/attend.h, group512, up to six queries; eight heads a KV
    head are split): every row has the bits it has alone, in any GQA shape, at contexts of a few pages to ~1,000
    keys, and the value is softmax attention."""
    torch.manual_seed(5)
    maxlen = 1024
    kc, vc = torch.randn(2, nkv, maxlen, hd), torch.randn(2, nkv, maxlen, hd)
    gen = torch.Generator().manual_seed(11)
    kp, table = _paged(kc, 16, gen)
    vp = torch.empty_like(kp)
    vp[table.flatten()] = vc.view(2, nkv, maxlen // 16, 16, hd).transpose(1, 2).reshape(-1, nkv, 16, hd)
    # a prompt's 7 positions of sequence 1, a check's 3 of sequence 0, one row of 1, then 1 again
    slots = torch.tensor([1] * 7 + [0] * 3 + [1, 0, 1])
    lens = torch.tensor([900 + i for i in range(7)] + [40, 41, 42] + [1, 1000, 17])
    q = torch.randn(len(slots), nh, hd)
    together = torch.ops.dmtd.attend(q, kp, vp, table, slots, lens, hd ** -0.5)
    torch.testing.assert_close(together.double(), _attention_reference(q, kc, vc, slots, lens), rtol=1e-5, atol=1e-5)
    for i in range(len(slots)):
        alone = torch.ops.dmtd.attend(q[i: i + 1], kp, vp, table, slots[i: i + 1], lens[i: i + 1], hd ** -0.5)
        assert torch.equal(alone[0], together[i])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # the units split over other numbers of threads
            torch.set_num_threads(n)
            assert torch.equal(torch.ops.dmtd.attend(q, kp, vp, table, slots, lens, hd ** -0.5), together)
    finally:
        torch.set_num_threads(threads)


def _bf16(x):
    return x.float().to(torch.bfloat16).double()


@pytest.mark.parametrize(("nh", "nkv", "hd"), [(9, 3, 64), (8, 2, 64), (4, 1, 32)])
def test_attend_gives_a_prompts_rows_one_kernel_however_the_prompt_is_cut(nh, nkv, hd):
    """A prompt's positions flagged (``prompt`` of dmtd::attend and dmtd::rows_layers): on an AMX build with heads of
    64 they attend on tiles (kernels/attend_amx.h) — softmax attention with q, k, v and the probabilities rounded to
    bf16, summed in float32 — elsewhere as decode rows do. Either way a row's bits are the same however the prompt is
    cut into calls and whatever shares the call (a check of another sequence before it, a decode row after), and
    the decode rows beside them keep theirs."""
    torch.manual_seed(6)
    maxlen, n = 320, 300
    kc, vc = torch.randn(2, nkv, maxlen, hd), torch.randn(2, nkv, maxlen, hd)
    kp, table = _paged(kc, 16, torch.Generator().manual_seed(2))
    vp = torch.empty_like(kp)
    vp[table.flatten()] = vc.view(2, nkv, maxlen // 16, 16, hd).transpose(1, 2).reshape(-1, nkv, 16, hd)
    slots, lens = torch.ones(n, dtype=torch.long), torch.arange(1, n + 1)  # sequence 1's positions 0 .. 299
    q = torch.randn(n, nh, hd)
    flags = torch.ones(n, dtype=torch.bool)
    s = hd ** -0.5
    whole = torch.ops.dmtd.attend(q, kp, vp, table, slots, lens, s, flags)
    as_decode = torch.ops.dmtd.attend(q, kp, vp, table, slots, lens, s)
    if lowbit.loaded_path() == "amx" and hd == 64:
        g = nh // nkv
        ref = torch.empty(n, nh, hd, dtype=torch.float64)
        for b in range(n):
            k = _bf16(kc[1, :, : lens[b]]).repeat_interleave(g, 0)
            v = _bf16(vc[1, :, : lens[b]]).repeat_interleave(g, 0)
            sc = (k @ _bf16(q[b]).unsqueeze(-1)).squeeze(-1) * s
            e = torch.exp(sc - sc.amax(-1, keepdim=True))
            ref[b] = (_bf16(e).unsqueeze(-1) * v).sum(1) / e.sum(-1, keepdim=True)
        torch.testing.assert_close(whole.double(), ref.reshape(n, nh * hd), rtol=1e-3, atol=1e-3)
        assert not torch.equal(whole, as_decode)  # the tiles, not the float32 kernel
        torch.testing.assert_close(whole, as_decode, rtol=0.05, atol=0.05)
    else:
        assert torch.equal(whole, as_decode)
    for cuts in ((0, 1, n), (0, 17, 150, 151, n)):
        parts = torch.cat([torch.ops.dmtd.attend(q[a:b], kp, vp, table, slots[a:b], lens[a:b], s, flags[a:b])
                           for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(parts, whole), cuts
    cq = torch.randn(3, nh, hd)
    mixed = torch.ops.dmtd.attend(torch.cat((cq[:2], q[100:140], cq[2:])), kp, vp, table,
                                  torch.tensor([0, 0] + [1] * 40 + [0]),
                                  torch.cat((torch.tensor([50, 51]), lens[100:140], torch.tensor([7]))), s,
                                  torch.tensor([False, False] + [True] * 40 + [False]))
    assert torch.equal(mixed[2:42], whole[100:140])
    decode = torch.ops.dmtd.attend(cq, kp, vp, table, torch.tensor([0, 0, 0]), torch.tensor([50, 51, 7]), s)
    assert torch.equal(mixed[[0, 1, 42]], decode)
    with pytest.raises(RuntimeError, match="one prompt flag per row"):
        torch.ops.dmtd.attend(q[:2], kp, vp, table, slots[:2], lens[:2], s, flags[:1])


def test_engine_decode_attention_by_the_kernel_matches_torchs_ops():
    """The decode loop's attention through dmtd::attend gives the same logits as through torch's ops (float32
    noise apart), one row or a chunk of one sequence (a verified check), and each engine is exact to its own τ = 1."""
    model = tiny_model(seed=5)
    dmtd = DMTDConfig(1, 3, 2, tau_max=4)
    cfg = EngineConfig(max_num_seqs=2, max_model_len=128, draft_quant="none")
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    got = {}
    for attend in (True, False):
        eng = LLMEngine(model, None, dmtd, cfg, default_tau=1, eos_token_ids=[])
        assert eng.runner.model.attend_kernel  # float32 KV on CPU, kernels built
        eng.runner.model.attend_kernel = attend
        got[attend] = [eng.generate([prompt], SamplingParams(max_new_tokens=24, tau=tau, exact=True))[0]
                       for tau in (1, 3)]
        assert got[attend][0].token_ids == got[attend][1].token_ids
    assert got[True][0].token_ids == got[False][0].token_ids
    assert got[True][1].num_drafted > 0
    # the verifier's top-1 probability of every token, one row (τ = 1) and checked chunks (τ = 3)
    for tau_i in (0, 1):
        torch.testing.assert_close(torch.tensor(got[True][tau_i].confidences),
                                   torch.tensor(got[False][tau_i].confidences), rtol=1e-4, atol=1e-5)


def test_kv_cache_dtype_bfloat16_halves_the_pool_and_is_refused_where_attention_would_round_differently():
    """``kv_cache_dtype``: bfloat16 stores a bfloat16 model's keys and values in bfloat16 (half the bytes a position,
    as the pool's sizing and the memory guard count them); a float32 model, or the amx path, is refused naming the
    field and why; other values are refused."""
    from dmtd.engine.config import ConfigError
    from dmtd.engine.kv_cache import bytes_per_position
    from dmtd.variants.memory import kv_pool_bytes

    dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, float32 or bfloat16, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype bfloat16: the model is not bfloat16"):
        LLMEngine(tiny_model(seed=1), None, dmtd, EngineConfig(max_num_seqs=2, max_model_len=64,
                                                                kv_cache_dtype="bfloat16"), eos_token_ids=[])
    model = tiny_model(seed=1).to(torch.bfloat16)
    cfgs = {kv: EngineConfig(max_num_seqs=2, max_model_len=64, dtype="bfloat16", kv_cache_dtype=kv)
            for kv in ("auto", "bfloat16")}
    if lowbit.loaded_path() == "amx":
        with pytest.raises(ConfigError, match="the amx path keeps float32"):
            LLMEngine(model, None, dmtd, cfgs["bfloat16"], eos_token_ids=[])
        return
    engines = {kv: LLMEngine(model, None, dmtd, c, eos_token_ids=[]) for kv, c in cfgs.items()}
    assert engines["auto"].runner.kv[0][0].dtype == torch.float32
    assert engines["bfloat16"].runner.kv[0][0].dtype == torch.bfloat16
    cfg = model.config
    assert bytes_per_position(cfg, dmtd, torch.bfloat16, torch.float32) < bytes_per_position(cfg, dmtd, torch.float32,
                                                                                            torch.float32)
    assert kv_pool_bytes(cfg, dmtd, cfgs["bfloat16"]) < kv_pool_bytes(cfg, dmtd, cfgs["auto"])
    out = [e.generate([[3, 5, 7, 11]], SamplingParams(max_new_tokens=12, tau=1))[0].token_ids for e in engines.values()]
    assert all(len(o) == 12 for o in out)
