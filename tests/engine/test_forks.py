"""Requests that share a sibling's prefill (``n`` > 1): one prefill pass, and tokens as if each had its own."""

from __future__ import annotations

import pytest

from dmtd.engine.sequence import SamplingParams
from tests.engine.test_exact import base_model, exact_engine, prompts_of, variant_of


def run(engine, prompt, params: list[SamplingParams], share: bool) -> tuple[list[list[int]], int]:
    """Tokens of each request, and how many of them a prefill pass ran."""
    prefilled: list[str] = []
    real = engine.runner.prefill

    def counting(seqs):
        prefilled.extend(s.req_id for s in seqs)
        return real(seqs)

    engine.runner.prefill = counting
    ids = [engine.add_request(prompt, p, req_id=f"r{i}", prefill_with="r0" if share and i else None)
           for i, p in enumerate(params)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    done: set[str] = set()
    while len(done) < len(ids):
        for o in engine.step():
            if o.token_id >= 0:
                out[o.req_id].append(o.token_id)
            if o.finished:
                done.add(o.req_id)
                engine.release(o.req_id)
    engine.runner.prefill = real
    return [out[i] for i in ids], len(set(prefilled))


@pytest.mark.parametrize("exact", [False, True])
def test_siblings_share_one_prefill_and_decode_as_if_alone(exact):
    var, verifier = variant_of(base_model(3, 0.2), 0.05, 3)
    prompt = prompts_of([11], 5)[0]
    params = [SamplingParams(temperature=0.9, seed=s, max_new_tokens=14, tau=3, exact=exact) for s in (1, 2, 3)]
    params.append(SamplingParams(max_new_tokens=14, tau=3, exact=exact))  # a greedy sibling
    alone, passes_alone = run(exact_engine(var, verifier), prompt, params, share=False)
    shared, passes_shared = run(exact_engine(var, verifier), prompt, params, share=True)
    assert (passes_alone, passes_shared) == (4, 1)
    assert shared == alone and len({tuple(t) for t in shared}) >= 3


def test_a_sibling_with_no_slot_or_an_aborted_parent_prefills_itself():
    var, verifier = variant_of(base_model(4, 0.2), 0.05, 4)
    prompt = prompts_of([9], 6)[0]
    params = [SamplingParams(temperature=0.8, seed=s, max_new_tokens=8, tau=2) for s in (1, 2, 3)]
    alone, _ = run(exact_engine(var, verifier), prompt, params, share=False)
    tight, passes = run(exact_engine(var, verifier, max_num_seqs=2), prompt, params, share=True)
    assert tight == alone and passes == 2  # the third found no slot: it queued and prefilled itself
    engine = exact_engine(var, verifier)
    engine.add_request(prompt, params[0], req_id="r0")
    engine.add_request(prompt, params[1], req_id="r1", prefill_with="r0")
    engine.add_request(prompt, params[2], req_id="r2", prefill_with="r0")
    assert engine.abort("r2") and engine.abort("r0")
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.req_id == "r1" and o.token_id >= 0]
    assert len(out) == 8 and engine.scheduler.num_free_kv_rows == 8
