"""``dmtd bench serve`` against the test stack: every policy and concurrency measured, JSON + PNG written."""

from __future__ import annotations

import argparse
import json

from dmtd.serve.bench import add_bench_serve_args, run_bench_serve, summarize


def test_bench_serve_runs_all_policies(stack, tmp_path):
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    out = tmp_path / "serve.json"
    args = p.parse_args(["--server", stack.grpc_target, "--concurrency", "1,2", "--requests-per-worker", "1",
                         "--max-new-tokens", "8", "--rate", "4", "--open-requests", "3", "--json", str(out)])
    result = run_bench_serve(args, "unused")
    rows = json.loads(out.read_text())["rows"]
    assert {(r["policy"], r.get("concurrency")) for r in rows if r["mode"] == "closed"} == {
        (p, n) for p in ("tau1", "tau3", "adaptive") for n in (1, 2)}
    assert {r["policy"] for r in rows if r["mode"] == "open"} == {"tau1", "tau3", "adaptive"}
    for r in rows:
        assert r["tokens"] == 8 * r["requests"] and r["tokens_per_s"] > 0 and 0 <= r["slo_attainment"] <= 1
        assert r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0
    assert result["rows"] == rows and out.with_suffix(".png").stat().st_size > 5000


def test_summary_arithmetic():
    res = [{"ttft_ms": 100.0, "e2e_ms": 400.0, "tokens": 4, "itl_ms": [10.0, 10.0, 10.0]},
           {"ttft_ms": 3000.0, "e2e_ms": 3500.0, "tokens": 4, "itl_ms": [100.0, 100.0, 100.0]}]
    s = summarize(res, wall_s=2.0, ttft_slo=2000.0, itl_slo=50.0)
    assert s["tokens_per_s"] == 4.0 and s["slo_attainment"] == 0.5
    # nearest rank (dmtd_contract.stats.percentile): half of the six ITLs are <= 10 ms
    assert s["itl_p50_ms"] == 10.0 and s["ttft_p95_ms"] == 3000.0
