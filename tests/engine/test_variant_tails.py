"""Many variants over one trunk in one engine: mixed batches (trunk rows together, tails by variant), each variant's
tokens as its own engine writes them, the exact profile's the base model's (HF transformers greedy), trunk pages shared
across variants by the prefix cache, bad variants refused naming the rule."""

from __future__ import annotations

import json

import pytest
import torch

from dmtd.engine.config import ConfigError, EngineConfig
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.manifest import ManifestError
from dmtd.variants.paths import SHIPPED_VARIANTS
from dmtd.variants.tails import load_tails, trunk_of
from tests.variants.tails_helpers import make_variant

CHATS = ["Write a haiku about autumn.", "What is the capital of France?", "How do bees make honey?",
         "Name three planets.", "Why is exercise good for you?", "What causes rain?"]
CFG = EngineConfig(max_num_seqs=8, max_model_len=384)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The shipped variant's engine with two more variants of its trunk loaded beside it."""
    spec = engine_spec(None, "smollm2-135m-dmtd", search_dirs=[SHIPPED_VARIANTS])
    engine = build_engine(spec, CFG)
    trunk = trunk_of(spec.loaded.path, spec.loaded.config, spec.dmtd)
    root = tmp_path_factory.mktemp("variants")
    dirs = {n: make_variant(root / n, n, seed) for n, seed in (("other", 1), ("third", 2))}
    for name, d in dirs.items():
        got = load_tails(trunk, d, torch.float32)
        assert got.manifest.name == name
        assert engine.add_variant(name, got.layers) > 50e6  # eight decoding layers of float32
    return engine, trunk, dirs


def chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": c}] for c in CHATS[:n]]


def test_a_mixed_batch_gives_each_variant_what_its_own_engine_writes(served):
    engine, _, dirs = served
    assert engine.variants == ["other", "third"]
    params = SamplingParams(max_new_tokens=24, tau=3)
    variants = ["", "other", "third", "other", "", "third"]
    mixed = engine.generate(chats(6), params, variants)
    own = engine.generate(chats(6), params)  # the engine's own variant, alone
    alone = build_engine(engine_spec(None, str(dirs["other"])), CFG)
    other = alone.generate(chats(6), params)
    assert [mixed[i].token_ids for i in (0, 4)] == [own[i].token_ids for i in (0, 4)]
    assert [mixed[i].token_ids for i in (1, 3)] == [other[i].token_ids for i in (1, 3)]
    # distinct variants write distinct text at τ = 3 (their tails differ), so the groups really ran apart
    assert own[1].token_ids != other[1].token_ids
    assert mixed[2].token_ids != own[2].token_ids


def test_exact_answers_of_every_variant_in_a_mixed_batch_are_the_base_models(served, smollm2):
    from transformers import AutoModelForCausalLM

    engine, _, _ = served
    params = SamplingParams(max_new_tokens=24, tau=3, exact=True)
    got = engine.generate(chats(3) * 2, params, ["", "other", "third", "third", "", "other"])
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    for r in got[:3]:
        ids = torch.tensor([r.prompt_token_ids])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              pad_token_id=0)
        expected = out[0, ids.shape[1]:].tolist()
        assert r.token_ids == expected[: len(r.token_ids)] and len(r.token_ids) >= min(len(expected), 8)
    assert [r.token_ids for r in got[3:]] == [r.token_ids for r in got[:3]]  # the same prompts, other variants
    assert sum(r.num_drafted for r in got) > 20  # every variant drafted (its tails ran), the verifier decided


def test_trunk_pages_are_shared_across_variants_on_a_shared_system_prompt(served):
    engine, _, _ = served
    system = {"role": "system", "content": " ".join(["You are a careful assistant who answers briefly."] * 30)}
    prompts = [[system, {"role": "user", "content": c}] for c in CHATS[:3]]
    before = engine.cache_report()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, exact=True), [""])
    rest = engine.generate(prompts[1:], SamplingParams(max_new_tokens=4, exact=True), ["other", "third"])
    after = engine.cache_report()
    assert after["prefix_hits"] - before["prefix_hits"] >= 2  # the other variants read the first one's trunk pages
    assert after["prefix_cached_tokens"] - before["prefix_cached_tokens"] >= 2 * 256  # two whole chunks each
    assert all(r.finish_reason for r in rest)
    # an unverified answer reads its own variant's decoding-group KV: no pages across variants there
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, tau=2), [""])
    hits = engine.cache_report()["prefix_hits"]
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, tau=2), ["other"])
    assert engine.cache_report()["prefix_hits"] == hits


def test_bad_variants_are_refused_naming_the_rule(served, tmp_path):
    engine, trunk, dirs = served
    with pytest.raises(RequestError, match="variant: 'nope' is not loaded here"):
        engine.add_request([1, 2, 3], SamplingParams(), variant="nope")
    with pytest.raises(ManifestError, match="num_decoding_layers is 6"):
        load_tails(trunk, make_variant(tmp_path / "d6", "d6", 3, num_thinking_layers=22, num_decoding_layers=6),
                   torch.float32)
    bad = make_variant(tmp_path / "bad", "bad", 4)
    (bad / "adapter.safetensors").write_bytes(b"corrupt")
    with pytest.raises(ManifestError, match="adapter checksum mismatch"):
        load_tails(trunk, bad, torch.float32)
    data = json.loads((dirs["other"] / "variant.json").read_text())
    with pytest.raises(ConfigError, match="'other': a name not loaded yet"):
        engine.add_variant("other", load_tails(trunk, dirs["other"], torch.float32).layers)
    assert data["name"] == "other"


def test_a_variant_goes_only_when_its_requests_are_done(served, tmp_path):
    engine, trunk, _ = served
    d = make_variant(tmp_path / "brief", "brief", 5)
    engine.add_variant("brief", load_tails(trunk, d, torch.float32).layers)
    layers = engine.runner.state.tails["brief"]
    rid = engine.add_request(engine.encode(chats(1)[0]), SamplingParams(max_new_tokens=3), variant="brief")
    with pytest.raises(ConfigError, match="'brief' still has 1 unfinished request"):
        engine.remove_variant("brief")
    while engine.has_unfinished():
        engine.step()
    engine.release(rid)
    engine.remove_variant("brief")
    assert engine.variants == ["other", "third"]
    assert all(held[0] is not layers for held in engine.runner.model._fused_args.values())  # nothing keeps them
    with pytest.raises(RequestError, match="'brief' is not loaded here"):
        engine.add_request([1, 2, 3], SamplingParams(), variant="brief")
