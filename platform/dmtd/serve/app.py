"""The Serve application: the gateway (``dmtd.serve.ingress``: gRPC + OpenAI HTTP) in front of one ``DMTDReplica``
deployment per variant. ``build_app(args)`` is the import path KubeRay's serveConfigV2 and ``dmtd serve`` use;
its arguments are ``dmtd_contract.serve_config.ServeConfig``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve

from dmtd.serve.engine_builder import EngineBuilder
from dmtd.serve.ingress import GatewayIngress
from dmtd.serve.readiness import DRAIN_GRACE_S
from dmtd.serve.requests import Limits
from dmtd.serve.settings import (
    ServeConfig,
    gateway_process_env,
    replica_process_env,
    serve_config,
    telemetry_args,
)

__all__ = ["EngineBuilder", "GatewayIngress", "build_app", "finished_spans"]


def build_app(args: ServeConfig | Mapping[str, Any]) -> Any:
    """The Serve application of a ``ServeConfig`` (a dict is validated into one first, with the environment's
    fallbacks: dmtd.serve.settings.serve_config). Each field's meaning, default and rule is in the model; the
    measurements behind the process settings (niceness, Serve's threads, OpenMP) are in docs/benchmarks.md
    ("The stack against the engine", "OpenMP wait policy"). A bad value raises ``ServeConfigError``, here, at
    build time."""
    cfg = args if isinstance(args, ServeConfig) else serve_config(args)
    replica_env, gateway_env = replica_process_env(cfg), gateway_process_env(cfg)
    limits = Limits(**cfg.limits).model_dump()  # refused here, at build time, when a limit is malformed
    telemetry = telemetry_args(cfg)
    # several replicas: each takes the CPUs Ray reserves for it (``replica_num_cpus``) as its torch threads, not
    # every core of its node (replicas sharing a node would each spin a thread per core)
    total_replicas = sum(cfg.replicas_of(v) for v in cfg.variants)
    shared_threads = max(1, int(cfg.replica_num_cpus)) if total_replicas > 1 else 0
    replica_actor: dict[str, Any] = {"num_cpus": cfg.replica_num_cpus}
    if replica_env:
        replica_actor["runtime_env"] = {"env_vars": dict(replica_env)}
    router: dict[str, Any] = {}
    if cfg.routing == "prefix":  # the replica likeliest to hold the prompt's prefix (Serve's default: pow2)
        from ray.serve.config import RequestRouterConfig

        cls: Any = "dmtd.serve.prefix_router:PrefixRouter"
        router["request_router_config"] = RequestRouterConfig(request_router_class=cls)
    from dmtd.serve.replica import DMTDReplica

    handles, infos, deployments = {}, [], {}
    for i, v in enumerate(cfg.variants):
        engine = cfg.engine(v)
        builder = EngineBuilder(variant=v.loads, model=v.model, decoding_layers=v.decoding_layers, tau_max=v.tau_max,
                                torch_threads=cfg.torch_threads or shared_threads, settings=engine,
                                load_format=v.load_format)
        name = "DMTDReplica" if i == 0 else f"DMTDReplica-{v.name}"
        dep: Any = serve.deployment(DMTDReplica, name=name, num_replicas=cfg.replicas_of(v),
                                    max_ongoing_requests=engine.max_num_seqs + engine.max_queued + 8,
                                    health_check_period_s=5, ray_actor_options=dict(replica_actor),
                                    graceful_shutdown_timeout_s=DRAIN_GRACE_S + 5, **router)
        handles[v.name] = dep.bind(builder, engine.max_queued, None, cfg.registry_url, v.name, telemetry, limits,
                                   cfg.stream_interval_ms, list(v.tails), cfg.max_variants)
        deployments[v.name] = name
        infos.append({"name": v.name, "base_model": v.model or "smollm2", "status": "active",
                      "traffic_weight": v.weight})
    actor: dict[str, Any] = {"num_cpus": 0}
    if gateway_env:
        actor["runtime_env"] = {"env_vars": dict(gateway_env)}
    if cfg.gateway_resources:  # on Kubernetes: pinned to the head pod, which the gateway Service targets
        actor["resources"] = dict(cfg.gateway_resources)
    # a stopping replica or gateway first lets its streams in flight finish (Gateway.drain)
    gateway: Any = serve.deployment(GatewayIngress, name="Gateway", num_replicas=1, max_ongoing_requests=1000,
                                    ray_actor_options=actor, graceful_shutdown_timeout_s=DRAIN_GRACE_S + 5)
    return gateway.bind(handles, infos, cfg.default, cfg.grpc_host, cfg.grpc_port, cfg.max_inflight, cfg.registry_url,
                        telemetry, deployments, limits, cfg.api_keys_file, cfg.tls_cert_file, cfg.tls_key_file,
                        cfg.block_push, cfg.http_host, cfg.http_port)


def finished_spans(app_name: str, deployment: str) -> list[dict[str, Any]]:
    """The spans a running deployment of ``app_name`` (``Gateway``, ``DMTDReplica``) keeps in memory; the caller is
    the Ray driver of the stack (``dmtd bench serve`` reads its stages from them)."""
    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    return list(handle.finished_spans.remote().result())
