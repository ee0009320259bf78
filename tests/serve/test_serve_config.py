"""The typed serving config (dmtd_contract.serve_config): one set of defaults, errors that name the field and its
rule, the environment's fallbacks, a variant's overrides, and the registry info a route holds."""

from __future__ import annotations

import pytest

from dmtd.serve.routing import Route, Router
from dmtd.serve.settings import EngineSettings, ServeConfig, ServeConfigError, engine_default, serve_config
from dmtd_contract.registry import RouteInfo, VariantEntry


def test_defaults_come_from_the_model_and_blank_means_default() -> None:
    cfg = serve_config({}, environ={})
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.kv_cache_tokens) == (64, 8192, 32768)
    assert cfg.max_num_seqs == engine_default("max_num_seqs") == EngineSettings().max_num_seqs
    assert [v.name for v in cfg.variants] == ["default"] and cfg.variants[0].loads == "none"
    blank = serve_config({"max_num_seqs": None, "kv_cache_tokens": "", "drafts": None}, environ={})
    assert (blank.max_num_seqs, blank.kv_cache_tokens, blank.drafts) == (64, 32768, "adaptive")


@pytest.mark.parametrize(("args", "message"), [
    ({"max_num_seqs": 0}, "max_num_seqs: input should be greater than or equal to 1, got 0"),
    ({"routing": "round-robin"}, "routing: input should be 'prefix' or 'pow2', got 'round-robin'"),
    ({"phrase_drafts": "maybe"}, "phrase_drafts: must be true or false, got 'maybe'"),
    ({"variants": [{"name": "a", "weigth": 1}]}, "variants.0.weigth: not a setting"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, "variants: names must be unique"),
    ({"max_num_seq": 8}, "max_num_seq: not a setting"),
])
def test_a_bad_setting_names_its_field_and_rule(args, message) -> None:
    with pytest.raises(ServeConfigError) as caught:
        serve_config(args, environ={})
    assert message in str(caught.value)


def test_the_environment_fills_what_the_args_leave_out() -> None:
    env = {"DMTD_STREAM_INTERVAL_MS": "5", "DMTD_BLOCK_PUSH": "off", "DMTD_SERVE_USER_THREAD": "1"}
    cfg = serve_config({}, environ=env)
    assert (cfg.stream_interval_ms, cfg.block_push, cfg.serve_user_thread) == (5.0, "off", True)
    given = serve_config({"stream_interval_ms": 12, "block_push": None}, environ=env)
    assert (given.stream_interval_ms, given.block_push) == (12.0, "auto")  # named in the args: the env stays out


def test_a_variant_overrides_the_apps_engine_settings() -> None:
    cfg = ServeConfig.parse({"max_num_seqs": 8, "drafts": "fixed", "phrase_drafts": False, "variants": [
        {"name": "a"}, {"name": "b", "model_uri": "/m", "drafts": "adaptive", "phrase_drafts": "true", "replicas": 2}]})
    a, b = (cfg.engine(v) for v in cfg.variants)
    assert (a.max_num_seqs, a.drafts, a.phrase_drafts) == (8, "fixed", False)
    assert (b.max_num_seqs, b.drafts, b.phrase_drafts) == (8, "adaptive", True)
    assert cfg.variants[1].model == "/m" and [cfg.replicas_of(v) for v in cfg.variants] == [1, 2]


def test_telemetry_fields_ride_at_top_level() -> None:
    from dmtd.serve.settings import telemetry_args

    cfg = serve_config({"deployment": "d", "metrics_port": 9, "itl_slo_ms": 80, "grpc_host": "0.0.0.0"}, environ={})
    assert telemetry_args(cfg) == {"deployment": "d", "metrics_port": 9, "itl_slo_ms": 80.0, "metrics_host": "0.0.0.0"}


def test_a_route_holds_typed_registry_info() -> None:
    router = Router({"v": Route("v", object(), RouteInfo(name="v", base_model="smollm2", traffic_weight=1.0))}, "v")
    assert router.infos() == [{"name": "v", "base_model": "smollm2", "status": "active", "traffic_weight": 1.0,
                               "is_default": True}]
    entry = VariantEntry(name="v", num_thinking_layers=22, num_decoding_layers=8, tau_max=4, default_tau=2,
                         status="active", traffic_weight=0.5, revision=3)
    router.update("v", RouteInfo.from_entry(entry), revision=7)
    (info,) = router.infos()
    assert (info["tau_max"], info["default_tau"], info["revision"], info["verifier"]) == (4, 2, 3, "")
    assert router.revision == 7
    assert router.routes["v"].weight == 0.5
    with pytest.raises(ValueError, match="status"):
        router.update("v", {"status": "paused"})
    assert router.routes["v"].active  # a refused change leaves the route as it was


def test_the_replicas_engine_takes_the_phrase_drafts_setting() -> None:
    """`phrase_drafts: false` (`dmtd serve --no-phrase-drafts`) reaches the replica's engine: no phrase table."""
    from dmtd.serve.engine_builder import EngineBuilder

    engine, _ = EngineBuilder(variant="smollm2-135m-dmtd", torch_threads=1, settings=EngineSettings(
        max_num_seqs=2, max_model_len=256, phrase_drafts=False))()
    assert engine.cfg.phrase_drafts is False and engine.phrase_table is None and engine.cfg.context_drafts is True


def test_what_the_operator_renders_is_what_build_app_accepts() -> None:
    """The RayService's args (dmtd_operator.render) pass the serving side's own check, engine settings included."""
    import yaml

    from dmtd_operator import render
    from dmtd_operator.spec import DMTDDeploymentSpec

    spec = DMTDDeploymentSpec.model_validate({"variants": [{"name": "v", "modelUri": "registry://smollm2-135m-dmtd"}],
                                              "engine": {"maxNumSeqs": 8, "phraseDrafts": False},
                                              "serving": {"tlsSecret": "tls"}})
    rs = render.ray_service(render.Target("d", "ns", spec, 1, 1, 4, "redis://x"))
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    cfg = serve_config(args, environ={})
    assert (cfg.namespace, cfg.variants[0].loads, cfg.grpc_host, cfg.tls_key_file) == (
        "ns", "smollm2-135m-dmtd", "0.0.0.0", f"{render.TLS_DIR}/tls.key")
    assert cfg.engine(cfg.variants[0]) == EngineSettings(max_num_seqs=8, phrase_drafts=False)


def test_the_replicas_engine_takes_the_prefill_pace_and_a_bad_one_names_the_field() -> None:
    """`prefill_pace` (`dmtd serve --prefill-pace`, the CR's `spec.engine.prefillPace`) reaches the replica's engine;
    a negative or non-finite one is refused naming the field."""
    from dmtd.serve.engine_builder import EngineBuilder

    engine, _ = EngineBuilder(variant="smollm2-135m-dmtd", torch_threads=1, settings=EngineSettings(
        max_num_seqs=2, max_model_len=256, prefill_pace=0.5))()
    assert engine.cfg.prefill_pace == 0.5 and engine.pacer.pace == 0.5
    for bad in (-1, float("nan"), float("inf"), "fast"):
        with pytest.raises(ServeConfigError, match="prefill_pace"):
            serve_config({"prefill_pace": bad}, environ={})
