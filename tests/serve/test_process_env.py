"""The settings ``build_app`` reads (dmtd_contract.serve_config.ServeConfig, through dmtd.serve.settings): the
processes' environment, stream interval, drafts, and the replica's engine settings."""

from __future__ import annotations

import pytest

from dmtd.serve.settings import DEFAULT_STREAM_INTERVAL_MS, EngineSettings, serve_config
from dmtd.serve.settings import gateway_process_env as _gateway_env
from dmtd.serve.settings import replica_process_env as _replica_env

KNOBS = ("DMTD_WORKER_NICENESS", "DMTD_GATEWAY_NICENESS", "DMTD_SERVE_USER_THREAD", "DMTD_SERVE_ROUTER_THREAD",
         "DMTD_OMP_WAIT_POLICY", "DMTD_OMP_SPIN_COUNT", "DMTD_STREAM_INTERVAL_MS")


def gateway_process_env(args):
    return _gateway_env(serve_config(args))


def replica_process_env(args):
    return _replica_env(serve_config(args))


def stream_interval(args):
    return serve_config(args).stream_interval_ms


def drafts_setting(value):
    return EngineSettings.model_validate({"drafts": value}).drafts


def context_drafts_setting(value):
    return EngineSettings.model_validate({"context_drafts": value}).context_drafts


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


def test_the_stream_interval_defaults_reads_the_environment_and_names_its_field(monkeypatch):
    assert stream_interval({}) == DEFAULT_STREAM_INTERVAL_MS == stream_interval({"stream_interval_ms": None}) > 0
    assert stream_interval({"stream_interval_ms": 0}) == 0.0 and stream_interval({"stream_interval_ms": "12.5"}) == 12.5
    monkeypatch.setenv("DMTD_STREAM_INTERVAL_MS", "0")
    assert stream_interval({}) == 0.0 and stream_interval({"stream_interval_ms": 25}) == 25.0
    for bad in (-1, 1001, "soon", float("nan")):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            stream_interval({"stream_interval_ms": bad})


def test_drafts_default_to_adaptive_and_name_their_field():
    assert drafts_setting(None) == drafts_setting("") == drafts_setting("adaptive") == "adaptive"
    assert drafts_setting("fixed") == "fixed"
    with pytest.raises(ValueError, match="drafts"):
        drafts_setting("sometimes")
    assert context_drafts_setting(None) is context_drafts_setting("") is context_drafts_setting("True") is True
    assert context_drafts_setting(False) is context_drafts_setting("false") is False
    with pytest.raises(ValueError, match="context_drafts: must be true or false, got 'sometimes'"):
        context_drafts_setting("sometimes")


def test_the_replicas_engine_takes_the_context_drafts_setting():
    """`context_drafts: false` (`dmtd serve --no-context-drafts`) reaches the replica's engine; the default is on."""
    from dmtd.serve.engine_builder import EngineBuilder

    for setting in (True, False):
        engine, _ = EngineBuilder(variant="smollm2-135m-dmtd", torch_threads=1, settings=EngineSettings(
            max_num_seqs=2, max_model_len=256, context_drafts=setting))()
        assert engine.cfg.context_drafts is setting and engine.cfg.adaptive_drafts is True
    assert EngineBuilder().settings.context_drafts is True
