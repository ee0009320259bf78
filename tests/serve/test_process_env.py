"""The environment ``build_app`` gives the gateway's and the replicas' Ray worker processes."""

from __future__ import annotations

import pytest

from dmtd.serve.app import gateway_process_env, replica_process_env

KNOBS = ("DMTD_WORKER_NICENESS", "DMTD_GATEWAY_NICENESS", "DMTD_SERVE_USER_THREAD", "DMTD_SERVE_ROUTER_THREAD",
         "DMTD_OMP_WAIT_POLICY", "DMTD_OMP_SPIN_COUNT")


@pytest.fixture(autouse=True)
def _no_knobs(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)


def test_defaults_put_our_code_and_serves_router_on_one_loop_at_normal_priority():
    gw, rep = gateway_process_env({}), replica_process_env({})
    for env in (gw, rep):
        assert env["RAY_worker_niceness"] == "0" and env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert gw["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0" and "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP" not in rep
    assert "GOMP_SPINCOUNT" not in rep and "OMP_WAIT_POLICY" not in rep  # OpenMP's own waits by default


def test_serves_own_defaults_and_openmp_settings_on_request(monkeypatch):
    args = {"worker_niceness": None, "serve_user_thread": True, "router_thread": True, "omp_spin_count": 2000}
    gw, rep = gateway_process_env(args), replica_process_env(args)
    assert gw == {} and rep == {"GOMP_SPINCOUNT": "2000"}
    assert replica_process_env({"omp_wait_policy": "passive", "omp_spin_count": 2000})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in replica_process_env({"omp_wait_policy": "PASSIVE", "omp_spin_count": 2000})
    monkeypatch.setenv("DMTD_OMP_SPIN_COUNT", "7000")
    monkeypatch.setenv("DMTD_WORKER_NICENESS", "5")
    assert replica_process_env({})["GOMP_SPINCOUNT"] == "7000" and replica_process_env({})["RAY_worker_niceness"] == "5"
    assert gateway_process_env({"gateway_niceness": 10})["RAY_worker_niceness"] == "10"
    assert replica_process_env({"gateway_niceness": 10})["RAY_worker_niceness"] == "5"


@pytest.mark.parametrize(("args", "field"), [
    ({"worker_niceness": 40}, "worker_niceness"),
    ({"worker_niceness": "high"}, "worker_niceness"),
    ({"gateway_niceness": "-21"}, "gateway_niceness"),
    ({"omp_spin_count": "fast"}, "omp_spin_count"),
    ({"omp_spin_count": -3}, "omp_spin_count"),
    ({"omp_wait_policy": "sometimes"}, "omp_wait_policy"),
])
def test_bad_settings_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        replica_process_env(args) if field != "gateway_niceness" else gateway_process_env(args)
