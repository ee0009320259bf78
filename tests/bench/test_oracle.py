"""The oracle drafter of ``dmtd bench engine`` (dmtd.bench.oracle_bench): verified cycles whose drafts the verifier
accepts at a chosen rate, on a tiny dummy shape; the output stays the base model's."""

from __future__ import annotations

import pytest

from dmtd.bench.oracle_bench import OracleDrafts, cycle_bound, expected_tokens, oracle_rows, parse_acceptances
from dmtd.bench.roofline import MachineRates
from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig, ModelConfig
from dmtd.engine.sequence import SamplingParams, Sequence
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.shapes import export_shape
from tests.variants.test_shapes import tiny_shape


def test_acceptances_parse_and_bad_ones_name_the_flag():
    assert parse_acceptances("0, 0.5,0.8,1") == [0.0, 0.5, 0.8, 1.0]
    assert parse_acceptances("") == []
    for bad in ("1.5", "-0.1", "nan", "half"):
        with pytest.raises(ConfigError, match="--oracle-acceptance takes a comma list of fractions in"):
            parse_acceptances(f"0,{bad}")
    assert expected_tokens(0.5, 3) == 1.75 and expected_tokens(1.0, 3) == 3 and expected_tokens(0.0, 4) == 1


def _at(prompt: list[int], generated: list[int], drafts: list[int] = ()) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_new_tokens=2000, exact=True), tau=3)
    seq.token_ids += generated
    if drafts:
        seq.draft.add(list(drafts), "tails")
    return seq


def test_the_oracle_drafts_the_reference_right_or_wrong_by_its_rate():
    refs = {(1, 2, 3): [10, 11, 12, 13, 14]}
    assert OracleDrafts(refs, 1.0, 100).replace(_at([1, 2, 3], [10]), 7) == 11
    assert OracleDrafts(refs, 0.0, 100).replace(_at([1, 2, 3], [10]), 7) == 12  # wrong: the right token + 1
    assert OracleDrafts(refs, 1.0, 100).replace(_at([1, 2, 3], [10], [11]), 7) == 12  # the next position
    assert OracleDrafts(refs, 1.0, 100).replace(_at([1, 2, 3], [10, 11, 12, 13, 14]), 7) == 7  # past the reference
    assert OracleDrafts(refs, 1.0, 100).replace(_at([4, 5], [10]), 7) == 7  # a prompt it does not know
    ref = list(range(2000))
    half = OracleDrafts({(1,): ref}, 0.5, 5000)
    right = [half.replace(_at([1], ref[:j]), -1) == j for j in range(1, 2000)]
    assert 0.45 < sum(right) / len(right) < 0.55
    again = OracleDrafts({(1,): ref}, 0.5, 5000)  # seeded: the same positions are wrong
    assert right == [again.replace(_at([1], ref[:j]), -1) == j for j in range(1, 2000)]


def test_verified_cycles_with_oracle_drafts_accept_at_the_rate_and_write_the_base_models_tokens(tmp_path):
    folder = export_shape(tiny_shape("qwen3"), tmp_path / "tiny")
    spec = engine_spec(str(folder), "none", decoding_layers=2, load_format="dummy")
    engine = build_engine(spec, EngineConfig(max_num_seqs=3, max_model_len=256))
    ids = spec.loaded.tokenizer.encode("The history of the printing press begins", add_special_tokens=False)
    rows = oracle_rows(engine, ids, batch=3, tau=3, acceptances=[0.0, 0.5, 1.0], new_tokens=24, repeats=1,
                       bound=lambda tokens: 100.0 * tokens)
    base, none, half, every = rows
    assert base["system"] == "oracle-base" and base["tok_s"] > 0 and base["step_s"] > 0
    assert all(r["exact"] for r in rows[1:])  # the check decides: the base model's own tokens at every rate
    assert none["acceptance"] == 0.0 and none["tokens_per_cycle"] == 1.0
    assert every["acceptance"] == 1.0 and every["tokens_per_cycle"] == 3.0  # 24 tokens in 8 cycles of 3
    assert 0.0 < half["first_draft_acceptance"] < 1.0 and 1.0 < half["tokens_per_cycle"] < 3.0
    assert every["bound_tok_s"] == 300.0 and half["bound_tok_s"] == 175.0
    assert all(r["tail_cost"] > 0 and r["check_cost"] > 0 for r in rows[1:])
    assert engine.cycles.tail_stand_in is None  # the engine's own drafts again
    # and the engine's tails, untouched, write the same tokens
    plain = engine.generate([ids], SamplingParams(max_new_tokens=25, tau=3, exact=True, ignore_eos=True))[0]
    assert plain.token_ids == engine.generate([ids], SamplingParams(max_new_tokens=25, ignore_eos=True))[0].token_ids


def test_the_cycle_bound_counts_a_check_and_the_draft_passes():
    cfg = ModelConfig.from_hf(tiny_shape("llama") | {"hidden_size": 2048, "intermediate_size": 8192,
                                                      "num_attention_heads": 32, "head_dim": 64,
                                                      "num_key_value_heads": 8, "num_hidden_layers": 16})
    dmtd = DMTDConfig.plain(16, 4, tau_max=3)
    rates = MachineRates(copy_gb_s=40, matvec_gb_s=40, matmul_gflop_s=1e6, matmul_bf16_gflop_s=1e6)
    one = cycle_bound(cfg, dmtd, 3, 1, 64, "bfloat16", rates, 40.0, None, 1.0)
    every = cycle_bound(cfg, dmtd, 3, 1, 64, "bfloat16", rates, 40.0, None, 3.0)
    assert every == pytest.approx(3 * one)
    assert cycle_bound(cfg, dmtd, 3, 1, 64, "bfloat16", rates, 40.0, 40.0, 3.0) > every  # int8 drafts read less
