"""The cost model's arithmetic, worked by hand."""

from __future__ import annotations

import math

import pytest

from dmtd.telemetry import cost


def test_replica_price_and_gpu_seconds():
    assert cost.replica_usd_per_hour(2.5, 4) == 10.0
    assert cost.replica_usd_per_hour(0.1, 0) == 0.1  # a CPU replica counts as one unit
    assert cost.gpu_seconds_per_request(wall_s=60.0, requests=30, gpus_per_replica=2) == 4.0
    with pytest.raises(ValueError):
        cost.gpu_seconds_per_request(1.0, 0)


def test_dollars_per_million_tokens():
    # $3.60/hour at 1000 tok/s = 3.6M tokens/hour → $1 per 1M tokens
    assert cost.usd_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert cost.usd_per_million_tokens(2.0, 100.0) == pytest.approx(2.0 / 360000 * 1e6)
    with pytest.raises(ValueError):
        cost.usd_per_million_tokens(1.0, 0.0)


def test_saving_against_tau1():
    assert cost.saving_vs_tau1(tokens_per_s=150.0, tau1_tokens_per_s=100.0) == pytest.approx(1 / 3)
    assert cost.saving_vs_tau1(100.0, 100.0) == 0.0
    assert cost.saving_vs_tau1(50.0, 100.0) == pytest.approx(-1.0)  # slower costs more
    # the saving in $/1M tokens is the same number
    a, b = cost.usd_per_million_tokens(4.0, 150.0), cost.usd_per_million_tokens(4.0, 100.0)
    assert 1 - a / b == pytest.approx(cost.saving_vs_tau1(150.0, 100.0))


def test_cost_per_slo_compliant_request():
    # $36/hour for 100 s = $1, 50 requests of which 80 % met the SLO → $1/40
    assert cost.usd_per_slo_request(36.0, 100.0, 50, 0.8) == pytest.approx(0.025)
    assert math.isinf(cost.usd_per_slo_request(36.0, 100.0, 50, 0.0))


def test_instances_and_monthly_cost():
    # 864M tokens/day = 10,000 tok/s; 3,000 tok/s per replica → 4 replicas (3.33 rounded up)
    assert cost.instances_needed(864e6, 3000.0) == 4
    assert cost.instances_needed(864e6, 2500.0) == 4  # exactly 4.0 needs no fifth
    assert cost.instances_needed(864e6, 2500.0, target_utilization=0.8) == 5
    assert cost.instances_needed(864e6, 2500.0, peak_to_mean=2.0) == 8
    assert cost.instances_needed(1.0, 1000.0) == 1  # at least one
    assert cost.usd_per_month(4, 2.5) == 4 * 2.5 * 730
    with pytest.raises(ValueError):
        cost.instances_needed(1e6, 100.0, target_utilization=0.0)
