"""``dmtd cost report`` over a ``dmtd bench serve`` result: the table, JSON, PNG and HTML, and its numbers."""

from __future__ import annotations

import json

import pytest

from dmtd.cli import main
from dmtd.telemetry.report import build_report


def row(policy: str, n: int, tok_s: float, att: float, wall_s: float = 10.0, requests: int = 20,
        ttft: float = 500.0, itl: float = 40.0) -> dict:
    return {"policy": policy, "mode": "closed", "concurrency": n, "tokens_per_s": tok_s, "slo_attainment": att,
            "wall_s": wall_s, "requests": requests, "tokens": int(tok_s * wall_s), "ttft_p50_ms": ttft / 2,
            "ttft_p95_ms": ttft, "itl_p50_ms": itl / 2, "itl_p95_ms": itl, "e2e_p50_ms": 1.0, "e2e_p95_ms": 2.0}


BENCH = {"target": "x", "variant": "smol-d8", "max_new_tokens": 64, "ttft_slo_ms": 2000.0, "itl_slo_ms": 50.0,
         "rows": [row("tau1", 1, 20.0, 1.0), row("tau1", 4, 40.0, 0.9), row("tau3", 1, 30.0, 1.0),
                  row("tau3", 4, 60.0, 0.95), row("adaptive", 1, 25.0, 0.5), row("adaptive", 4, 50.0, 0.4),
                  {**row("tau1", 0, 1.0, 1.0), "mode": "open", "rate": 2.0}]}


def test_report_numbers():
    r = build_report(BENCH, daily_tokens=8.64e6, slo_attainment=0.95, usd_per_gpu_hour=3.6, gpus_per_replica=1)
    t1, t3, ad = (r["policies"][p] for p in ("tau1", "tau3", "adaptive"))
    # τ=1 at N=4 misses 95 %: its operating point is N=1 at 20 tok/s; τ=3 meets it at N=4 (60 tok/s)
    assert (t1["concurrency"], t1["tokens_per_s"], t1["meets_slo"]) == (1, 20.0, True)
    assert (t3["concurrency"], t3["tokens_per_s"], t3["meets_slo"]) == (4, 60.0, True)
    assert ad["meets_slo"] is False and ad["concurrency"] == 1  # best attainment when none meets it
    # $3.6/h at 20 tok/s = 72k tok/h → $50/1M; at 60 tok/s → $16.67/1M
    assert t1["usd_per_million_tokens"] == pytest.approx(50.0)
    assert t3["usd_per_million_tokens"] == pytest.approx(50.0 / 3)
    # 8.64M tokens/day = 100 tok/s → 5 replicas at 20 tok/s, 2 at 60 tok/s
    assert (t1["instances"], t3["instances"]) == (5, 2)
    assert t1["usd_per_month"] == pytest.approx(5 * 3.6 * 730) and t3["usd_per_month"] == pytest.approx(2 * 3.6 * 730)
    assert t3["saving_vs_tau1"] == pytest.approx(2 / 3) and t1["saving_vs_tau1"] == 0.0
    assert t3["usd_per_month_saved_vs_tau1"] == pytest.approx(3 * 3.6 * 730)
    # 10 s at $3.6/h = $0.01 over 20 x 0.95 compliant requests
    assert t3["usd_per_slo_request"] == pytest.approx(0.01 / 19)
    assert t3["gpu_seconds_per_request"] == pytest.approx(0.5)


def test_stricter_itl_slo_moves_the_operating_point():
    r = build_report(BENCH, 8.64e6, 0.9, 3.6, itl_slo_ms=30.0)
    assert all(not p["meets_slo"] for p in r["policies"].values())  # every row has ITL p95 40 ms
    assert r["itl_slo_ms"] == 30.0


def test_cli_writes_table_json_png_html(tmp_path, capsys):
    bench = tmp_path / "serve.json"
    bench.write_text(json.dumps(BENCH))
    assert main(["cost", "report", str(bench), "--daily-tokens", "8.64e6", "--usd-per-gpu-hour", "3.6",
                 "--out", str(tmp_path / "out" / "cost")]) == 0
    out = capsys.readouterr().out
    assert "usd_per_million_tokens" in out and "$50.00" in out and "$16.67" in out
    report = json.loads((tmp_path / "out" / "cost.json").read_text())
    assert report["policies"]["tau3"]["instances"] == 2
    png = (tmp_path / "out" / "cost.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    page = (tmp_path / "out" / "cost.html").read_text()
    assert "<table>" in page and "data:image/png;base64," in page and "http" not in page.split("<body>")[1]


def test_cli_rejects_unknown_replica_type(tmp_path):
    bench = tmp_path / "serve.json"
    bench.write_text(json.dumps(BENCH))
    with pytest.raises(SystemExit, match="unknown --replica-type"):
        main(["cost", "report", str(bench), "--replica-type", "tpu-v9"])
