"""``dmtd cost report`` over a real ``dmtd bench serve`` result from the test stack: table, JSON, PNG, HTML."""

from __future__ import annotations

import argparse
import json

import pytest

from dmtd.bench.serve_bench import add_bench_serve_args, run_bench_serve
from dmtd.cli import main
from dmtd.telemetry import cost


def test_cost_report_over_a_measured_bench(stack, tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    bench_path = tmp_path / "serve.json"
    run_bench_serve(p.parse_args(["--server", stack.grpc_target, "--concurrency", "1,2", "--requests-per-worker", "1",
                                  "--max-new-tokens", "8", "--policies", "tau1,tau3", "--json", str(bench_path)]),
                    "unused")
    capsys.readouterr()
    assert main(["cost", "report", str(bench_path), "--daily-tokens", "1e6", "--slo-attainment", "0.5",
                 "--replica-type", "l4"]) == 0
    table = capsys.readouterr().out
    assert "tau1" in table and "tau3" in table and "usd_per_month" in table
    out = tmp_path / "serve-cost"
    report = json.loads(out.with_suffix(".json").read_text())
    bench = json.loads(bench_path.read_text())
    for policy, r in report["policies"].items():
        row = next(b for b in bench["rows"] if b["policy"] == policy and b["concurrency"] == r["concurrency"])
        assert r["tokens_per_s"] == row["tokens_per_s"]
        assert r["usd_per_million_tokens"] == pytest.approx(0.80 / (row["tokens_per_s"] * 3600) * 1e6)
        assert r["instances"] == cost.instances_needed(1e6, row["tokens_per_s"])
        assert r["usd_per_month"] == pytest.approx(r["instances"] * 0.80 * 730)
    assert report["policies"]["tau3"]["saving_vs_tau1"] == pytest.approx(
        1 - report["policies"]["tau1"]["tokens_per_s"] / report["policies"]["tau3"]["tokens_per_s"])
    assert out.with_suffix(".png").stat().st_size > 10000 and "<table>" in out.with_suffix(".html").read_text()
