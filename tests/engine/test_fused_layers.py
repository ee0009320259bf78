"""Layer groups of the exact profile in one call: the draft path's layers (``dmtd::draft_layers``) and decode rows
(``dmtd::rows_layers``) on packed weights compute what the layer loop computes, and int8 drafts keep the output the
verifier's."""

from __future__ import annotations

import pytest
import torch

from dmtd.engine.config import DMTDConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.engine.verifier import Verifier
from tests.conftest import tiny_engine, tiny_model
from tests.engine.test_exact import DMTD, base_model, prompts_of, variant_of


def _packed_draft_runner(seed: int, num_seqs: int, g: torch.Generator, **arch: object):
    """A tiny exact-profile runner with int8 (i8dot) draft weights (E = 1, D = 2) and random KV; returns it, its
    config, its model, and a function that puts that KV back. ``arch``: the tiny model's config fields (a qkv bias,
    q/k norms)."""
    from dmtd.engine.config import EngineConfig

    dmtd = DMTDConfig(1, 3, 2, tau_max=4, head_input="replace")
    model = tiny_model(seed=seed, **arch)
    eng = LLMEngine(model, None, dmtd, EngineConfig(max_num_seqs=num_seqs, max_model_len=64, draft_quant="int8"),
                    default_tau=1, eos_token_ids=[], verifier=Verifier("base", "replace", None))
    r = eng.runner
    r.enable_exact()
    return r, dmtd, model, _random_kv(r, num_seqs, g)


def _random_kv(r, num_seqs: int, g: torch.Generator):
    """Random KV in every slot's pages of runner ``r`` (each cache row its own pages, in order — row 0: pages 0 .. —
    as the scheduler gives them); returns a function that puts that KV back."""
    for slot in range(num_seqs):
        assert r.cache.pages.grow(slot, 64)
    for k, v in r.kv:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    kv0 = [(k.clone(), v.clone()) for k, v in r.kv]

    def reset() -> None:
        for (k, v), (k0, v0) in zip(r.kv, kv0):
            k.copy_(k0)
            v.copy_(v0)

    return reset


@pytest.mark.parametrize("arch", [{}, {"qkv_bias": True, "qk_norm": True}], ids=["llama", "bias-and-qk-norms"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_draft_layers_compute_the_layer_loop_with_the_packed_draft_weights(rows, arch):
    """Drafts of one sequence run each layer group in one call (dmtd::draft_layers) on int8 draft weights: the
    same values, and the same KV written, as the layer loop over those weights (E = 1 encoding layer, D = 2)."""
    g = torch.Generator().manual_seed(0)
    r, dmtd, model, reset = _packed_draft_runner(7, 2, g, **arch)
    assert r.draft_format == "i8dot" and r.drafts.fused is not None
    h = torch.randn(rows, 64, generator=g)
    last, slot = 11, 1

    for start, end in ((0, dmtd.thinking_start), (dmtd.decoding_start, dmtd.num_layers)):
        reset()
        fused = r.verified._draft_stack(h, start, end, slot, last, r.drafts.fused_for(""))  # the engine's own
        kv_fused = [(k.clone(), v.clone()) for k, v in r.kv]
        reset()
        ctx = r.state.context([slot], torch.arange(last - rows + 1, last + 1)[None], None)
        model.fused_layers = False  # the TorchScript layer loop
        with torch.inference_mode():
            loop = model.run_layers(h[None], start, end, ctx.cos, ctx.sin, r.kv, ctx, r.drafts.layers)[0]
        model.fused_layers = True
        torch.testing.assert_close(fused, loop, rtol=1e-4, atol=1e-5)
        for (k, v), (kf, vf) in zip(r.kv, kv_fused):
            torch.testing.assert_close(kf, k, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(vf, v, rtol=1e-5, atol=1e-6)
        assert not torch.equal(fused, h)


@pytest.mark.parametrize("arch", [{}, {"qk_norm": True}, {"qkv_bias": True, "qk_norm": True}],
                         ids=["llama", "qwen3", "bias-and-qk-norms"])
def test_rows_layers_compute_the_layer_loop_for_batches_chunks_and_padding(arch):
    """Decode rows of packed weights run a layer group in one call (dmtd::rows_layers): a batch of one position a
    slot, a chunk of one slot's consecutive positions, and right-aligned rows with padding (a check of two
    sequences with different draft counts) get the values and the KV the layer loop computes, padding is written
    nowhere, and a row gets the same bits alone as beside others. Qwen3's per-head q/k norms and a qkv bias run in
    the op too (they had sent a Qwen3 shape's every layer to the TorchScript loop: 74.6 ms a token at batch 1 where
    the products take ~32)."""
    g = torch.Generator().manual_seed(1)
    r, dmtd, model, reset = _packed_draft_runner(3, 3, g, **arch)
    assert model.fused_layers
    kv0 = [(k.clone(), v.clone()) for k, v in r.kv]
    # the op, not a fallback: the decoding group's packed weights and float32 KV qualify
    assert model.rows_args(r.drafts.layers, r.kv, dmtd.decoding_start, dmtd.num_layers) is not None

    def run(slots, pos, valid, h, fused):
        reset()
        model.fused_layers = fused
        ctx = r.state.context(slots, pos, valid)
        with torch.inference_mode():
            out = model.run_layers(h, dmtd.decoding_start, dmtd.num_layers, ctx.cos, ctx.sin, r.kv, ctx,
                                   r.drafts.layers)
        model.fused_layers = True
        return out, [(k.clone(), v.clone()) for k, v in r.kv]

    cases = [([0, 2], torch.tensor([[7], [12]]), None),
             ([1], torch.tensor([[9, 10, 11]]), None),
             ([2, 0], torch.tensor([[4, 5, 6], [0, 9, 10]]), torch.tensor([[True] * 3, [False, True, True]]))]
    for slots, pos, valid in cases:
        h = torch.randn(*pos.shape, 64, generator=g)
        fused, kv_fused = run(slots, pos, valid, h, True)
        loop, kv_loop = run(slots, pos, valid, h, False)
        keep = torch.ones(pos.shape, dtype=torch.bool) if valid is None else valid
        torch.testing.assert_close(fused[keep], loop[keep], rtol=1e-4, atol=1e-5)
        for (k, v), (kf, vf) in zip(kv_loop, kv_fused):
            torch.testing.assert_close(kf, k, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(vf, v, rtol=1e-5, atol=1e-6)
        if valid is not None:  # the padding entry (slot 0, position 0) keeps the KV it had
            assert all(torch.equal(kf[0, :, 0], k0[0, :, 0]) for (kf, _), (k0, _) in zip(kv_fused, kv0))
    # a row alone: the same bits as beside the others
    slots, pos = [0, 2], torch.tensor([[7], [12]])
    h = torch.randn(2, 1, 64, generator=g)
    both, _ = run(slots, pos, None, h, True)
    alone, _ = run(slots[1:], pos[1:], None, h[1:], True)
    assert torch.equal(both[1], alone[0])


def _packed_runner_of(model, num_seqs: int, g: torch.Generator):
    """A bf16 engine's runner over ``model`` (packed weights, the rows op) with random KV in every slot's pages; and a
    function that puts that KV back."""
    from dmtd.engine.config import EngineConfig

    dmtd = DMTDConfig(1, 3, 2, tau_max=4, head_input="replace")
    eng = LLMEngine(model, None, dmtd, EngineConfig(max_num_seqs=num_seqs, max_model_len=64, dtype="bfloat16"),
                    default_tau=1, eos_token_ids=[])
    r = eng.runner
    return r, dmtd, _random_kv(r, num_seqs, g)


@pytest.mark.parametrize("heads", [(4, 2, 16), (3, 1, 64)])
def test_rows_layers_give_prompt_rows_their_bits_however_the_calls_split_them(heads):
    """A prompt's prefill runs as rows of one call, or of several wherever the scheduler splits it: two slots' 41
    positions each in one call of 82 rows (the norms' and the MLP's rows shared by the threads, the norms eight rows
    side by side; heads of 64 on an AMX build attend on tiles, blocks of 16 rows) and the same positions as calls of
    5 and of 77 rows, or of 13, 40 and 29, give every row the same bits and write the same KV. Prompt rows beside
    decode rows in one call (a check carrying a prompt) keep their bits too, and the check's rows theirs (the
    kernel's values: test_lowbit.py)."""
    from dmtd.engine.model import StepContext

    nh, nkv, hd = heads
    g = torch.Generator().manual_seed(4)
    model = tiny_model(seed=5, num_heads=nh, num_kv_heads=nkv, head_dim=hd).to(torch.bfloat16)
    r, dmtd, reset = _packed_runner_of(model, 3, g)
    rows = [(0, p) for p in range(41)] + [(1, p) for p in range(41)]  # (slot, position), in the order of a call
    h = torch.randn(1, len(rows), 64, generator=g)

    def call(part: slice, prompt: bool = True, rows=rows, h=h) -> torch.Tensor:
        slots = torch.tensor([s for s, _ in rows[part]])
        pos = torch.tensor([p for _, p in rows[part]])
        none = torch.empty(0)
        r.cache.sync()  # the page table as the pages hold it
        flags = torch.full(pos.shape, prompt)
        ctx = StepContext(none, none, None, int(pos.max()) + 1, slots[:0], r.cache.table, slots, pos, None, flags)
        with torch.inference_mode():
            return model.run_rows(h[:, part], 0, dmtd.num_layers, r.kv, ctx, r.weights)

    assert model.rows_args(r.weights, r.kv, 0, dmtd.num_layers) is not None
    reset()
    whole = call(slice(None))
    kv_whole = [(k.clone(), v.clone()) for k, v in r.kv]
    for cuts in ((0, 5, 82), (0, 13, 53, 82)):
        reset()
        parts = torch.cat([call(slice(a, b)) for a, b in zip(cuts, cuts[1:])], dim=1)
        assert torch.equal(parts, whole), cuts
        assert all(torch.equal(k, kw) and torch.equal(v, vw) for (k, v), (kw, vw) in zip(r.kv, kv_whole))
    reset()
    decoded = call(slice(None), prompt=False)
    from dmtd.engine import lowbit

    assert torch.equal(decoded, whole) == (hd != 64 or lowbit.loaded_path() != "amx")  # which kernel ran
    # a check's rows of slot 2 first, then slot 0's prompt rows: the prompt rows' bits as alone
    mixed_rows = [(2, 50), (2, 51), *rows[:41]]
    mixed_h = torch.cat((torch.randn(1, 2, 64, generator=g), h[:, :41]), dim=1)
    reset()
    slots = torch.tensor([s for s, _ in mixed_rows])
    pos = torch.tensor([p for _, p in mixed_rows])
    flags = torch.tensor([False, False] + [True] * 41)
    r.cache.sync()
    none = torch.empty(0)
    ctx = StepContext(none, none, None, int(pos.max()) + 1, slots[:0], r.cache.table, slots, pos, None, flags)
    with torch.inference_mode():
        mixed = model.run_rows(mixed_h, 0, dmtd.num_layers, r.kv, ctx, r.weights)
    assert torch.equal(mixed[:, 2:], whole[:, :41])
    reset()
    check = call(slice(0, 2), prompt=False, rows=mixed_rows, h=mixed_h)
    assert torch.equal(mixed[:, :2], check)


@pytest.mark.parametrize("draft_quant", ["int8", "none"])
def test_int8_drafts_keep_the_output_the_verifiers(draft_quant):
    base = base_model(4, 0.3)
    var, verifier = variant_of(base, 0.02, 4)
    prompts = prompts_of([5, 9, 3], 4)
    ref = tiny_engine(base, DMTD).generate(prompts, SamplingParams(max_new_tokens=24, tau=1))
    from dmtd.engine.config import EngineConfig

    eng = LLMEngine(var, None, DMTD, EngineConfig(max_num_seqs=4, max_model_len=256, draft_quant=draft_quant),
                    default_tau=1, eos_token_ids=[], verifier=verifier)
    for batch in (prompts, prompts[:1]):  # a batch (the layer loop) and one sequence (the fused call)
        got = eng.generate(batch, SamplingParams(max_new_tokens=24, tau=3, exact=True))
        assert [x.token_ids for x in got] == [x.token_ids for x in ref[: len(batch)]]
        assert sum(x.num_accepted for x in got) > 0
    assert eng.runner.draft_format == ("i8dot" if draft_quant == "int8" else None)
