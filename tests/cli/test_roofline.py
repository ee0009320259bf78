"""Roofline arithmetic of ``dmtd bench engine`` (pure functions)."""

from __future__ import annotations

import pytest

from dmtd.bench.roofline import MachineRates, bound_tok_s, layer_bytes, lm_head_bytes
from dmtd.engine.config import DMTDConfig, ModelConfig

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_weight_bytes_of_smollm2():
    assert layer_bytes(SMOL) == (576 * 960 + 576 * 576 + 3 * 576 * 1536 + 2 * 576) * 4
    assert 30 * layer_bytes(SMOL) / 1e6 == pytest.approx(425, rel=0.01)
    assert lm_head_bytes(SMOL) / 1e6 == pytest.approx(113, rel=0.01)


@pytest.mark.parametrize("tau,expected", [(2, 1.41), (3, 1.63), (4, 1.77)])
def test_memory_bound_speedups_match_design(tau, expected):
    """docs/design.md §4: D=8 counting weight bytes gives 1.41×, 1.63×, 1.77× over AR."""
    rates = MachineRates(copy_gb_s=15, matvec_gb_s=10, matmul_gflop_s=1e6)
    dmtd = DMTDConfig.plain(30, 8, 4)
    ar = bound_tok_s(SMOL, None, 1, 1, 0, rates)
    dm = bound_tok_s(SMOL, dmtd, tau, 1, 0, rates)
    assert dm["bound_tok_s"] / ar["bound_tok_s"] == pytest.approx(expected, abs=0.01)
    assert ar["bound_tok_s"] == pytest.approx(10e9 / (30 * layer_bytes(SMOL) + lm_head_bytes(SMOL)))


def test_compute_bound_batches_gain_nothing():
    rates = MachineRates(copy_gb_s=15, matvec_gb_s=1e6, matmul_gflop_s=100)
    dmtd = DMTDConfig.plain(30, 8, 4)
    ar = bound_tok_s(SMOL, None, 1, 64, 128, rates)
    dm = bound_tok_s(SMOL, dmtd, 3, 64, 128, rates)
    assert dm["limited_by"] == 1.0 and dm["bound_tok_s"] == pytest.approx(ar["bound_tok_s"])
