"""The Serve application: ``Gateway`` (gRPC + OpenAI HTTP ingress) in front of one ``DMTDReplica`` deployment per
variant. ``build_app(args)`` is the import path KubeRay's serveConfigV2 and ``dmtd serve`` use."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from ray import serve

from dmtd.serve import prefix_router
from dmtd.serve.auth import ApiKeys, server_credentials
from dmtd.serve.binding import bind_serve_internal_grpc
from dmtd.serve.controller import ControllerConfig
from dmtd.serve.gateway import GatewayCore, GatewayError, start_grpc_server
from dmtd.serve.openai_api import error_body, install_openapi, model_profile, read_body
from dmtd.serve.openai_models import expand, openai_field, openai_text, parse_body
from dmtd.serve.openai_route import OpenAIResponder
from dmtd.serve.push import BlockSink
from dmtd.serve.requests import InvalidRequest, Limits, TooLarge
from dmtd.serve.routing import Route, Router
from dmtd.serve.settings import (
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    block_push,
    context_drafts_setting,
    drafts_setting,
    gateway_process_env,
    replica_process_env,
    stream_interval,
)
from dmtd.telemetry.config import TelemetrySettings, telemetry_settings
from dmtd.telemetry.gateway import GatewayTelemetry
from dmtd.telemetry.logs import configure_json_logging
from dmtd.web import asset_path
from dmtd_contract import metric_names as m

# no /docs or /redoc: FastAPI's pages load their scripts from a CDN; /openapi.json stays
http_app = FastAPI(title="dmtd gateway", description="OpenAI-compatible API over DMTD replicas", docs_url=None,
                   redoc_url=None)
install_openapi(http_app)
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "INTERNAL": 500, "UNAVAILABLE": 503}


@dataclass(slots=True)
class EngineFactory:
    """Builds a replica's engine inside the replica process (picklable: plain settings only)."""

    variant: str = "none"
    model: str | None = None
    decoding_layers: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # the KV pool (dmtd.engine.kv_pages): positions shared by every sequence (default: 16 × 2,048, what 16 fixed
    # slots held before pages; never more than every sequence at max_model_len), or GiB of memory
    kv_cache_tokens: int | None = DEFAULT_KV_CACHE_TOKENS
    kv_cache_gib: float | None = None
    itl_slo_ms: float = 50.0
    tau_max: int | None = None
    torch_threads: int = 0
    dtype: str | None = None  # None: the variant's recommendation, else auto (dmtd.engine.lowbit.resolve_dtype)
    quant: str | None = None
    adaptive_drafts: bool = True  # exact requests: the draft count that pays (EngineConfig.adaptive_drafts)
    context_drafts: bool = True  # exact greedy requests: the context's own continuation (EngineConfig.context_drafts)

    def __call__(self) -> tuple[Any, ControllerConfig]:
        import torch

        from dmtd.engine.config import EngineConfig
        from dmtd.variants.build import build_engine, engine_spec, variant_precision
        from dmtd.variants.paths import SHIPPED_VARIANTS

        torch.set_num_threads(self.torch_threads or int(os.environ.get("DMTD_TORCH_THREADS", "0"))
                              or os.cpu_count() or 1)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype, quant = variant_precision(self.variant, self.dtype, self.quant, device)
        spec = engine_spec(self.model, self.variant, self.decoding_layers, dtype=getattr(torch, dtype), device=device,
                           search_dirs=[SHIPPED_VARIANTS])
        engine = build_engine(spec, EngineConfig(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                                                 kv_cache_tokens=None if self.kv_cache_gib or not self.kv_cache_tokens
                                                 else min(self.kv_cache_tokens, self.max_num_seqs * self.max_model_len),
                                                 kv_cache_gib=self.kv_cache_gib,
                                                 device=device, dtype=dtype, quant=quant,
                                                 adaptive_drafts=self.adaptive_drafts,
                                                 context_drafts=self.context_drafts))
        tau_max = min(self.tau_max or spec.dmtd.tau_max, spec.dmtd.tau_max)
        cfg = ControllerConfig(tau_min=1, tau_max=tau_max, rest_tau=min(spec.default_tau, tau_max),
                               rest_min_confidence=spec.min_confidence, itl_slo_ms=self.itl_slo_ms,
                               max_batch=self.max_num_seqs,
                               default_profile=spec.variant.default_profile if spec.variant is not None else "dmtd")
        return engine, cfg


class Gateway:
    """Serve ingress: runs the gRPC server on the replica's event loop and serves the OpenAI HTTP routes."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, replicas: dict[str, Any], variants: list[dict[str, Any]], default: str | None = None,
        grpc_host: str = "127.0.0.1", grpc_port: int = 9000, max_inflight: int = 64, registry_url: str | None = None,
        telemetry: dict[str, Any] | None = None, replica_deployments: dict[str, str] | None = None,
        limits: dict[str, Any] | None = None, api_keys_file: str | None = None, tls_cert_file: str | None = None,
        tls_key_file: str | None = None, block_push: str = "auto",
    ) -> None:
        bind_serve_internal_grpc()
        routes = {v["name"]: Route(v["name"], replicas[v["name"]], dict(v)) for v in variants}
        if telemetry is not None:
            configure_json_logging()
        self.telemetry = GatewayTelemetry(telemetry_settings(telemetry) if telemetry is not None
                                          else TelemetrySettings(metrics_port=None))
        self.sink = await BlockSink(_sink_host(block_push, grpc_host)).start() if block_push != "off" else None
        self.core = GatewayCore(Router(routes, default or (variants[0]["name"] if variants else None)), max_inflight,
                                self.telemetry, Limits(**(limits or {})), self.sink)
        self.keys = ApiKeys.load(api_keys_file)
        self.server, self.grpc_port = await start_grpc_server(self.core, grpc_host, grpc_port, self.keys,
                                                              server_credentials(tls_cert_file, tls_key_file))
        self.replica_deployments = replica_deployments or {}
        variant_of = {dep: v for v, dep in self.replica_deployments.items()}
        for v in variant_of.values():  # a zero series of each reason from the start
            for reason in prefix_router.REASONS:
                self.telemetry.ins.add(m.ROUTE_DECISIONS_TOTAL, 0, variant=v, reason=reason)
        prefix_router.LISTENERS.append(lambda dep, reason: self.telemetry.ins.add(
            m.ROUTE_DECISIONS_TOTAL, 1, variant=variant_of.get(dep, dep), reason=reason))
        self._ready_task = asyncio.get_running_loop().create_task(self._follow_replicas())
        self.view: Any = None
        if registry_url:
            from dmtd_contract.registry import RegistryClient, RegistryView

            self.view = RegistryView(RegistryClient(registry_url))
            self.view.add_listener(self._on_registry)
            await self.view.start()

    def _on_registry(self, snapshot: Any, change: Any) -> None:
        """Follow the registry: status, canary weight, τ range and default of every served variant."""
        router = self.core.router
        default = snapshot.default_name if hasattr(snapshot, "default_name") else None
        for name in list(router.routes):
            try:
                e = snapshot.get(name)
            except Exception:
                continue
            router.update(name, {"status": e.status, "traffic_weight": e.traffic_weight, "tau_min": e.tau_min,
                                 "tau_max": e.tau_max, "default_tau": e.default_tau,
                                 "min_confidence": e.min_confidence, "revision": e.revision,
                                 "num_encoding_layers": e.num_encoding_layers,
                                 "num_thinking_layers": e.num_thinking_layers,
                                 "num_decoding_layers": e.num_decoding_layers, "phase_anchor": e.phase_anchor,
                                 "head_input": e.head_input, "base_model": e.base_model,
                                 "default_profile": e.default_profile, "verifier": e.verifier or ""},
                                snapshot.revision)
        if default in router.routes:
            router.default = default

    async def _follow_replicas(self, period_s: float = 10.0, start_period_s: float = 1.0) -> None:
        """Keep the replicas-ready gauge (and the dashboard's $/hour) at Serve's count of running replicas.

        Every ``start_period_s`` until each variant has a running replica, then every ``period_s``, and never
        on this event loop's time: one ``serve.status()`` cost this process ~0.14 s of CPU (pydantic models
        and a cloudpickled router class per deployment; py-spy: 21% of the gateway's samples under load with
        a 2-s period), and the controller as much again, on the cores the replicas decode on. The controller's
        plain instance details, counted here, skip the models on this side."""
        from ray import serve
        from ray.serve.context import _get_global_client

        app: str | None = None
        while True:
            all_up = False
            with contextlib.suppress(Exception):
                app = app or serve.get_replica_context().app_name
                client: Any = _get_global_client()
                details = await client._controller.get_serve_instance_details.remote()
                deployments = details["applications"][app]["deployments"]
                for variant, dep in self.replica_deployments.items():
                    replicas = deployments.get(dep, {}).get("replicas", [])
                    self.telemetry.replicas_ready[variant] = sum(
                        1 for r in replicas if str(getattr(r.get("state"), "value", r.get("state"))) == "RUNNING")
                all_up = all(self.telemetry.replicas_ready.get(v, 0) > 0 for v in self.replica_deployments)
            await asyncio.sleep(period_s if all_up else start_period_s)

    async def warm(self, max_new_tokens: int = 2) -> dict[str, float]:
        """One short chat request per served variant through the gateway's own path (routing, the Serve handle's
        first call, the block channel, the replica's stream), so that a first client request does not pay them
        (``dmtd serve`` runs it before it says it serves); returns each variant's seconds."""
        from dmtd_contract.records import ReplicaRequest

        out = {}
        for name, route in list(self.core.router.routes.items()):
            t = time.perf_counter()
            req = ReplicaRequest(request_id=f"warm-{uuid.uuid4().hex[:12]}", prompt=None,
                                 messages=[{"role": "user", "content": "Hello!"}], max_new_tokens=max_new_tokens)
            async for _ in self.core.stream(route, req):
                pass
            out[name] = time.perf_counter() - t
        return out

    async def info(self) -> dict[str, Any]:
        sink = self.sink
        return {"grpc_port": self.grpc_port, "pid": os.getpid(), "inflight": self.core.inflight,
                "accepted": self.core.accepted,
                "completed": self.core.completed, "variants": self.core.router.infos(),
                "metrics_url": self.telemetry.metrics_url,
                "block_sink": None if sink is None else {"address": sink.address, "open": sink.num_open,
                                                         "frames": sink.num_frames, "dropped": sink.num_dropped}}

    async def finished_spans(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        """Finished spans held by the in-memory exporter (all, or one trace's)."""
        return self.telemetry.tracing.finished_spans(trace_id)

    def _refused(self, request: Request) -> JSONResponse | None:
        """401 unless the request carries an accepted API key (always None when no keys are configured)."""
        if self.keys.accepts_header(request.headers.get("authorization")):
            return None
        self.telemetry.rejected("", "UNAUTHENTICATED")
        basic = "/dashboard" in request.url.path  # a browser asks for the key as a password
        return JSONResponse(error_body("missing or invalid API key (send Authorization: Bearer <key>)",
                                       "authentication_error", code="invalid_api_key"), 401,
                            headers={"WWW-Authenticate": 'Basic realm="dmtd"' if basic else "Bearer"})

    @http_app.get("/dashboard")
    async def dashboard(self, request: Request) -> Any:
        if (refused := self._refused(request)) is not None:
            return refused
        path = asset_path("dashboard.html")
        assert path is not None, "dmtd.web is installed without its static assets"
        return FileResponse(path, media_type="text/html")

    @http_app.get("/dashboard/assets/{name}")
    async def dashboard_asset(self, name: str, request: Request) -> Any:
        if (refused := self._refused(request)) is not None:
            return refused
        path = asset_path(name)
        if path is None:
            return JSONResponse({"error": f"no asset {name!r}"}, 404)
        return FileResponse(path)

    @http_app.get("/dashboard/stats")
    async def dashboard_stats(self, request: Request) -> Any:
        return self._refused(request) or self.telemetry.stats()

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        data = [{"id": i["name"], "object": "model", "created": 0, "owned_by": "dmtd", "dmtd": model_profile(i)}
                for i in self.core.router.infos() if i.get("status", "active") == "active"]
        return self._refused(request) or {"object": "list", "data": data}

    @http_app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._openai(request, chat=False)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._openai(request, chat=True)

    async def _openai(self, request: Request, chat: bool) -> Any:
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            raw = await read_body(request, self.core.limits.max_body_bytes)
            req, body = parse_body(raw, chat, time.time(), self.core.limits)
            route = self.core.admit(body.model if body.model not in ("", "default") else "")
        except InvalidRequest as e:
            self.telemetry.rejected("", "INVALID_ARGUMENT")
            status = 413 if isinstance(e, TooLarge) else 400
            return JSONResponse(error_body(str(e), "invalid_request_error", e.field), status)
        except GatewayError as e:
            return self._error(e, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        responder = OpenAIResponder(self.core, route, body, expand(req, body.n or 1), chat, rid, self._error)
        return await responder.respond(request.headers.get("traceparent"))

    @staticmethod
    def _error(e: GatewayError, chat: bool = False) -> JSONResponse:
        status = HTTP_STATUS.get(e.code.name, 500)
        headers = {"Retry-After": str(max(1, (e.retry_after_ms or 1000) // 1000))} if status == 429 else None
        message, param = str(e), None
        if e.field:  # the replica names its own field; the client knows the OpenAI API's
            param = openai_field(e.field, chat)
            message = f"{param}: {openai_text(message.removeprefix(e.field + ': '))}"
        kind = "invalid_request_error" if status == 400 else e.code.name.lower()
        return JSONResponse(error_body(message, kind, param), status, headers=headers)


def _sink_host(setting: str, grpc_host: str) -> str:
    """The block sink's listening address for a ``block_push`` setting (dmtd.serve.settings.block_push)."""
    if setting != "auto":
        return setting
    if grpc_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if grpc_host != "::1" else "::1"
    import ray

    return str(ray.util.get_node_ip_address())  # what the replicas on other nodes reach this one by


# Applied at import time, in every process: Serve rewrites the class's routes on this module's app object,
# and replicas import this module afresh rather than unpickling the driver's rewritten app.
GatewayIngress = serve.ingress(http_app)(Gateway)


def build_app(args: dict[str, Any]) -> Any:
    """Serve application from args: ``variants`` [{name, variant?, model?, decoding_layers?, weight?}],
    ``grpc_port``, ``max_num_seqs``, ``max_queued``, ``replicas`` (per variant), ``itl_slo_ms``; telemetry:
    any ``TelemetrySettings`` field (``deployment``, ``metrics_port``, ``trace_exporter``, ``otlp_endpoint``,
    ``usd_per_gpu_hour``, ``gpus_per_replica`` …) at top level or in a ``telemetry`` dict. Edges: ``limits``
    (``Limits`` fields), ``api_keys_file`` (plus env ``DMTD_API_KEYS`` in the gateway's process),
    ``tls_cert_file`` / ``tls_key_file`` (gRPC TLS; HTTP TLS is Serve's ``http_options``).

    ``dtype`` (``auto`` / ``float32`` / ``bfloat16``) and ``quant`` (``none`` / ``int8`` / ``int4``), per variant
    or at top level; default: the variant manifest's recommendation, else ``auto`` / ``none``.

    ``drafts`` (per variant or at top level): how the replicas' engines draft for exact requests, ``adaptive``
    (default) or ``fixed`` (up to τ − 1 a cycle, stopping at the gate).

    ``block_push`` (default ``auto``; env ``DMTD_BLOCK_PUSH``): replicas push each block straight to a TCP sink
    of the gateway's (dmtd.serve.push) instead of streaming it as an item of the Serve call; ``auto`` listens on
    loopback when ``grpc_host`` is loopback, else on the gateway's node address; an IP address to listen on;
    ``off``: blocks travel as Serve items, gathered by ``stream_interval_ms``.

    ``stream_interval_ms`` (default 40; env ``DMTD_STREAM_INTERVAL_MS``; blocks that travel as Serve items): a
    replica streams a request's first and last block at once, and in between at most one Ray item per interval,
    carrying every block ready.

    ``omp_wait_policy`` (``PASSIVE`` / ``ACTIVE``; default: env ``DMTD_OMP_WAIT_POLICY``, else unset = OpenMP's
    own) is set in each replica's process. PASSIVE saves a CPU replica that shares its cores with other busy
    processes, and costs up to 2× on idle cores (docs/benchmarks.md, "OpenMP wait policy").

    ``omp_spin_count`` (``GOMP_SPINCOUNT``: how many spins, ~10 ns each, an idle OpenMP thread of a replica
    waits before it sleeps; default: env ``DMTD_OMP_SPIN_COUNT``, else the runtime's own, ~300000) is there to
    be measured: 5000 left the cores to the event loop and Ray between steps but made the steps slower
    (docs/benchmarks.md, "The stack against the engine"). Ignored when ``omp_wait_policy`` is set.

    The gateway's and the replicas' processes (docs/benchmarks.md, "The stack against the engine"):
    ``worker_niceness`` (default 0; ``None`` keeps Ray's 15, at which a replica yields its cores to anything
    else on the node, a load generator included), ``serve_user_thread`` (default False: our code runs on
    the event loop Serve streams from, saving a thread hop per streamed item; True is Serve's default) and
    ``router_thread`` (default False: the gateway's handles route on its own loop; True is Serve's default)."""
    variants = args.get("variants") or [{"name": "default", "variant": "none"}]
    replica_env, gateway_env = replica_process_env(args), gateway_process_env(args)
    handles, infos, deployments = {}, [], {}
    limits = Limits(**(args.get("limits") or {}))  # refused here, at build time, when a limit is malformed
    stream_interval_ms = stream_interval(args)
    push = block_push(args)
    telemetry = {k: args[k] for k in TelemetrySettings.model_fields if args.get(k) is not None}
    telemetry.update(args.get("telemetry") or {})
    telemetry.setdefault("metrics_host", args.get("grpc_host", "127.0.0.1"))  # on Kubernetes: 0.0.0.0
    # several replicas: each takes the CPUs Ray reserves for it (``replica_num_cpus``) as its torch threads, not
    # every core of its node (replicas sharing a node would each spin a thread per core)
    total_replicas = sum(int(v.get("replicas", args.get("replicas", 1))) for v in variants)
    shared_threads = max(1, int(float(args.get("replica_num_cpus", 1)))) if total_replicas > 1 else 0
    for i, v in enumerate(variants):
        factory = EngineFactory(variant=v.get("variant", v["name"]), model=v.get("model") or v.get("model_uri"),
                                decoding_layers=v.get("decoding_layers"),
                                max_num_seqs=int(args.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS),
                                max_model_len=int(args.get("max_model_len") or DEFAULT_MAX_MODEL_LEN),
                                kv_cache_tokens=int(args.get("kv_cache_tokens") or DEFAULT_KV_CACHE_TOKENS),
                                kv_cache_gib=args.get("kv_cache_gib"),
                                itl_slo_ms=float(args.get("itl_slo_ms", 50.0)), tau_max=v.get("tau_max"),
                                torch_threads=int(args.get("torch_threads", 0)) or shared_threads,
                                dtype=v.get("dtype", args.get("dtype")), quant=v.get("quant", args.get("quant")),
                                adaptive_drafts=drafts_setting(v.get("drafts", args.get("drafts"))) == "adaptive",
                                context_drafts=context_drafts_setting(v.get("context_drafts",
                                                                            args.get("context_drafts"))))
        from dmtd.serve.replica import DMTDReplica

        name = "DMTDReplica" if i == 0 else f"DMTDReplica-{v['name']}"
        max_ongoing = int(args.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS) + int(args.get("max_queued", 64)) + 8
        replicas = int(v.get("replicas", args.get("replicas", 1)))
        replica_actor: dict[str, Any] = {"num_cpus": float(args.get("replica_num_cpus", 1))}
        if replica_env:
            replica_actor["runtime_env"] = {"env_vars": dict(replica_env)}
        routing = str(args.get("routing", "prefix"))
        if routing not in ("prefix", "pow2"):
            raise ValueError(f"routing: must be prefix or pow2, got {routing!r}")
        router: dict[str, Any] = {}
        if routing == "prefix":  # the replica likeliest to hold the prompt's prefix (Serve's default: pow2)
            from ray.serve.config import RequestRouterConfig

            cls: Any = "dmtd.serve.prefix_router:PrefixRouter"
            router["request_router_config"] = RequestRouterConfig(request_router_class=cls)
        dep: Any = serve.deployment(DMTDReplica, name=name, num_replicas=replicas,
                               max_ongoing_requests=max_ongoing, health_check_period_s=5,
                               ray_actor_options=replica_actor, **router)
        handles[v["name"]] = dep.bind(factory, int(args.get("max_queued", 64)), None, args.get("registry_url"),
                                      v["name"], telemetry, limits.model_dump(), stream_interval_ms)
        deployments[v["name"]] = name
        infos.append({"name": v["name"], "base_model": str(v.get("model") or "smollm2"), "status": "active",
                      "traffic_weight": float(v.get("weight", 1.0))})
    actor: dict[str, Any] = {"num_cpus": 0}
    if gateway_env:
        actor["runtime_env"] = {"env_vars": dict(gateway_env)}
    if args.get("gateway_resources"):  # on Kubernetes: pinned to the head pod, which the gateway Service targets
        actor["resources"] = dict(args["gateway_resources"])
    gateway: Any = serve.deployment(GatewayIngress, name="Gateway", num_replicas=1,
                                    max_ongoing_requests=1000, ray_actor_options=actor)
    return gateway.bind(handles, infos, args.get("default"), args.get("grpc_host", "127.0.0.1"),
                        int(args.get("grpc_port", 9000)), int(args.get("max_inflight", 64)), args.get("registry_url"),
                        telemetry, deployments, limits.model_dump(), args.get("api_keys_file"),
                        args.get("tls_cert_file"), args.get("tls_key_file"), push)
