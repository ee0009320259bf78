"""GCS loss under load (tests/cluster/gcs_outage.py in its own process and private network namespace): a Ray node
with GCS fault tolerance (its state in an external Redis, as the operator renders it by default), the Serve app on it,
three gRPC clients in closed loops through the gateway from 4 s before the GCS is killed (for 10 s) until 12 s after
it is back. Nothing a client sees changes: zero failed requests, the same replica and gateway processes; a deploy
started during the outage waits for the GCS and completes after it; the node, the apps and the registry are as
before.

The head *pod* lost (Serve's controller and the dashboard die with it; the gateways on the ingress pods do not):
test_head_loss.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTAGE_S, AFTER_S = 10.0, 12.0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for unshare -n")
def test_a_gcs_outage_under_load_fails_no_request_and_keeps_every_replica(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up; exec {sys.executable} "
                           f"{ROOT / 'tests' / 'cluster' / 'gcs_outage.py'} {OUTAGE_S} {AFTER_S} {tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    records = r.pop("records")
    print(f"GCS down {r['t_back'] - r['t_kill']:.1f} s: {len(records)} requests, "
          f"{sum(1 for x in records if x['start'] >= r['t_kill'] and x['end'] <= r['t_back'])} of them within the "
          f"outage; deploy after {r['after']['seconds']:.1f} s; {sum(not x['ok'] for x in records)} failed")
    assert r["gcs_external"]  # the GCS kept its tables in Redis (RAY_REDIS_ADDRESS)
    failed = [x for x in records if not x["ok"]]
    assert failed == [] and len(records) >= 20, failed[:5]
    during = [x for x in records if x["start"] >= r["t_kill"] and x["end"] <= r["t_back"]]
    after = [x for x in records if x["start"] >= r["t_back"]]
    assert during and after  # requests started and finished while the GCS was down, and after it came back
    before = [x for x in records if x["end"] < r["t_kill"]]
    assert {n for x in before for n in x["replicas"]} == {n for x in after for n in x["replicas"]}  # same PIDs
    assert len({n for x in records for n in x["replicas"]}) == 1 and r["gateway_pid_same"]
    assert r["during"]["returned"] is False and r["during"]["error"] is None  # it waits; it is not lost:
    assert r["apps"] == {"dmtd": "RUNNING", "probe-during": "RUNNING", "probe-after": "RUNNING"}
    assert r["after"]["ok"] and r["after"]["seconds"] < 60
    assert r["nodes_alive"] == 1 and r["registry_status"] == "active"
