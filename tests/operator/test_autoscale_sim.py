"""`dmtd bench autoscale` (dmtd_operator.simulate): the burst acceptance numbers, determinism, outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmtd_operator import simulate
from dmtd_operator.sim.model import ReplicaModel


@pytest.fixture(scope="module")
def burst(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    out = tmp_path_factory.mktemp("sim") / "burst.json"
    assert simulate.main(["--traces", "burst", "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())["traces"]["burst"]


def test_tau_aware_holds_the_slo_through_a_3x_burst(burst: dict[str, dict[str, float]]) -> None:
    tau_aware, replica_only = burst["tau_aware"], burst["replica_only"]
    assert tau_aware["slo_attainment"] >= 0.99
    assert tau_aware["slo_attainment"] >= replica_only["slo_attainment"]
    assert tau_aware["gpu_hours"] <= replica_only["gpu_hours"]
    assert tau_aware["mean_tau"] > 1.0  # it used the tau knob
    assert replica_only["mean_tau"] == 1.0 and burst["ray_default"]["mean_tau"] == 1.0


def test_all_traces_and_policies_are_reported_deterministically(tmp_path: Path) -> None:
    args = ["--duration-s", "1200", "--no-progress", "--seed", "7"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert simulate.main([*args, "--json", str(a), "--png", str(tmp_path / "a.png")]) == 0
    assert simulate.main([*args, "--json", str(b)]) == 0
    first = json.loads(a.read_text())
    assert first["traces"] == json.loads(b.read_text())["traces"]
    assert set(first["traces"]) == {"steady", "diurnal", "burst", "ramp"}
    for per_policy in first["traces"].values():
        assert set(per_policy) == {"tau_aware", "replica_only", "ray_default"}
        for summary in per_policy.values():
            assert 0.0 <= summary["slo_attainment"] <= 1.0
            assert summary["gpu_hours"] > 0 and summary["usd_per_1m_tokens"] > 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_capacity_json_replaces_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps({"tok_s_by_tau": {"1": 1000, "2": 1500, "3": 1800, "4": 2000}}))
    assert ReplicaModel.capacity_from_json(capacity) == (1000.0, (1.0, 1.5, 1.8, 2.0))
    out = tmp_path / "r.json"
    argv = ["--traces", "steady", "--duration-s", "600", "--capacity-json", str(capacity), "--json", str(out)]
    assert simulate.main([*argv, "--no-progress"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["replica_tok_s"] == 1000.0 and config["tau_speedup"] == [1.0, 1.5, 1.8, 2.0]
    assert "steady" in capsys.readouterr().out


def test_unknown_trace_is_rejected() -> None:
    with pytest.raises(SystemExit, match="unknown trace"):
        simulate.main(["--traces", "tsunami", "--no-progress"])
