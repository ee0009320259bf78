"""Refill equivalence: incremental DMTD decoding equals the training-time masked forward (docs/design.md §1)."""

from __future__ import annotations

import pytest
import torch

from dmtd.engine.config import DMTDConfig
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_engine, tiny_model


def prompt_head_mask(dmtd: DMTDConfig, prompt_len: int, tau: int) -> list[bool]:
    if dmtd.phase_anchor == "prompt_end":
        return [True] * (prompt_len - 1)
    return [p % tau == 0 for p in range(prompt_len - 1)]


def reference_logits(model, dmtd, prompt: list[int], gen: list[int], gen_heads: list[bool], tau: int):
    """Masked forward over prompt + generated tokens; logits at the positions that produced ``gen``."""
    ids = prompt + gen[:-1]
    mask = prompt_head_mask(dmtd, len(prompt), tau) + gen_heads
    assert len(mask) == len(ids)
    with torch.no_grad():
        logits = model.forward_masked(torch.tensor([ids]), torch.tensor([mask]), dmtd)[0]
    return logits[len(prompt) - 1:]


def expected_heads(dmtd: DMTDConfig, prompt_len: int, n: int, tau: int) -> list[bool]:
    positions = range(prompt_len - 1, prompt_len - 1 + n)
    if dmtd.phase_anchor == "prompt_end":
        return [(p - (prompt_len - 1)) % tau == 0 for p in positions]
    return [p % tau == 0 for p in positions]


SPLITS = [(0, 4, 2), (1, 3, 2), (2, 2, 2)]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"E{s[0]}T{s[1]}D{s[2]}")
@pytest.mark.parametrize("head_input", ["residual_add", "replace"])
@pytest.mark.parametrize("anchor", ["prompt_end", "absolute"])
@pytest.mark.parametrize("tau", [2, 3, 4])
def test_incremental_equals_masked_forward(split, head_input, anchor, tau):
    model = tiny_model(seed=tau)
    dmtd = DMTDConfig(*split, tau_max=4, phase_anchor=anchor, head_input=head_input)
    engine = tiny_engine(model, dmtd)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 97, (11,), generator=g).tolist()
    res = engine.generate([prompt], SamplingParams(max_new_tokens=24, tau=tau))[0]
    assert len(res.token_ids) == 24
    assert res.head_flags == expected_heads(dmtd, len(prompt), 24, tau)
    ref = reference_logits(model, dmtd, prompt, res.token_ids, res.head_flags, tau)
    assert ref.argmax(-1).tolist() == res.token_ids
    # the fp32 logits themselves agree, not just their argmax
    solo = tiny_engine(model, dmtd)
    rid = solo.add_request(prompt, SamplingParams(max_new_tokens=24, tau=tau))
    got = []
    orig = solo.runner.state.logits

    def capture(h):
        out = orig(h)
        got.append(out[0].clone())
        return out

    solo.runner.state.logits = capture  # type: ignore[method-assign]
    while solo.has_unfinished():
        solo.step()
    assert solo.seqs[rid].generated_ids == res.token_ids
    # float32 noise: the engine's decode attention (dmtd::attend, or torch's ops) and the masked forward's SDPA sum
    # in different orders; against a float64 forward each path measured up to ~2e-4 off on these random models
    torch.testing.assert_close(torch.stack(got), ref, rtol=3e-4, atol=3e-4)


def test_tau_one_is_plain_autoregressive():
    """τ=1 with replace routing is the plain model: equals an all-heads full causal forward."""
    model = tiny_model(seed=3)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")
    engine = tiny_engine(model, dmtd)
    prompt = list(range(5, 20))
    res = engine.generate([prompt], SamplingParams(max_new_tokens=20, tau=1))[0]
    assert all(res.head_flags) and all(len(b) == 1 for b in res.blocks)
    ids = torch.tensor([prompt + res.token_ids[:-1]])
    with torch.no_grad():
        h = model.run_layers(model.embed_tokens(ids), 0, 6, *model.rope(torch.arange(ids.shape[1])[None]))
        logits = model.logits(h)[0, len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == res.token_ids


@pytest.mark.parametrize("anchor", ["prompt_end", "absolute"])
def test_mixed_batch_equals_each_alone(anchor):
    """Sequences at different phases, lengths and τ, admitted at different steps, equal their solo runs."""
    model = tiny_model(seed=11)
    dmtd = DMTDConfig(1, 3, 2, tau_max=4, phase_anchor=anchor, head_input="residual_add")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 5)]
    taus = [1, 2, 3, 4, 3]
    news = [20, 13, 25, 8, 17]
    solo = [tiny_engine(model, dmtd).generate([p], SamplingParams(max_new_tokens=n, tau=t))[0]
            for p, t, n in zip(prompts, taus, news)]

    engine = tiny_engine(model, dmtd, max_num_seqs=3, align_phases=False)
    rids: list[str] = []
    outs: dict[str, list[int]] = {}
    pending = list(zip(prompts, taus, news))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 4 == 0:  # staggered admission: new sequences join mid-flight
            p, t, n = pending.pop(0)
            rids.append(engine.add_request(p, SamplingParams(max_new_tokens=n, tau=t)))
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o.token_id)
        step += 1
    assert [outs[r] for r in rids] == [s.token_ids for s in solo]
    assert engine.scheduler.num_free_kv_rows == 3


def test_aligned_phases_share_head_steps_and_stay_exact():
    """With phase alignment, rows admitted at different steps head on the same decode steps after their
    first (shortened) cycle — and every row still equals the masked forward with its own head schedule."""
    model = tiny_model(seed=12)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="residual_add")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (4, 13, 7, 21)]
    engine = tiny_engine(model, dmtd, max_num_seqs=4, align_phases=True)
    rids: list[str] = []
    outs: dict[str, list] = {}
    decode_steps: list[tuple[set[str], set[str]]] = []  # (rows in a decode step, rows that headed)
    for i in range(60):
        if prompts and i % 3 == 0:  # admit a new row every 3 steps, at different phases of the clock
            rids.append(engine.add_request(prompts.pop(0), SamplingParams(max_new_tokens=30, tau=3)))
        step = engine.step()
        if not step:
            break
        if all(o.req_id in outs for o in step):  # a decode step (a prefill's rows are new)
            decode_steps.append(({o.req_id for o in step}, {o.req_id for o in step if o.is_head}))
        for o in step:
            outs.setdefault(o.req_id, []).append(o)
    assert len(rids) == 4
    for rid, n in zip(rids, (4, 13, 7, 21)):
        toks, flags = [o.token_id for o in outs[rid]], [o.is_head for o in outs[rid]]
        prompt = engine.seqs[rid].token_ids[:n] if rid in engine.seqs else None
        assert len(toks) == 30
        first = flags.index(True, 1)  # the first cycle is shortened to meet the shared clock, never lengthened
        assert 1 <= first <= 3
        assert all(f == ((i - first) % 3 == 0) for i, f in enumerate(flags) if i >= first)
        assert prompt is None or len(prompt) == n
    # once every row is past its first block, each decode step is a head step for all its rows or none
    settled = decode_steps[12:]
    assert settled and all(heads in (set(), rows) for rows, heads in settled)
    assert sum(1 for _, heads in settled if heads) * 3 >= len(settled) - 2
    assert engine.scheduler.num_free_kv_rows == 4


def test_aligned_rows_equal_masked_forward():
    model = tiny_model(seed=13)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = tiny_engine(model, dmtd, max_num_seqs=3, align_phases=True)
    outs: dict[str, list] = {}

    def collect() -> None:
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)

    rids = [engine.add_request(prompts[0], SamplingParams(max_new_tokens=20, tau=4))]
    collect()
    collect()  # the later rows join two decode steps into the first row's cycle
    rids += [engine.add_request(p, SamplingParams(max_new_tokens=20, tau=4)) for p in prompts[1:]]
    while engine.has_unfinished():
        collect()
    for i, (rid, prompt) in enumerate(zip(rids, prompts)):
        toks, flags = [o.token_id for o in outs[rid]], [o.is_head for o in outs[rid]]
        ref = reference_logits(model, dmtd, prompt, toks, flags, 4)
        assert ref.argmax(-1).tolist() == toks
        assert flags.index(True, 1) == (4 if i == 0 else 3)  # joined mid-clock: first cycle shortened


def test_smollm2_refill_equivalence(smollm2):
    """The real model with D = 8: incremental DMTD greedy equals the masked forward token for token."""
    dmtd = DMTDConfig.plain(30, 8, tau_max=4)
    from dmtd.engine.config import EngineConfig
    from dmtd.engine.llm import LLMEngine

    engine = LLMEngine(smollm2.model, smollm2.tokenizer, dmtd, EngineConfig(max_num_seqs=4, max_model_len=256))
    prompts = ["The history of the printing press", "def fibonacci(n):", "My favourite recipe for soup is"]
    for tau in (2, 3, 4):
        results = engine.generate(prompts, SamplingParams(max_new_tokens=24, tau=tau, ignore_eos=True))
        for res in results:
            ref = reference_logits(smollm2.model, dmtd, res.prompt_token_ids, res.token_ids, res.head_flags, tau)
            assert ref.argmax(-1).tolist() == res.token_ids
            assert res.head_flags == expected_heads(dmtd, len(res.prompt_token_ids), 24, tau)
