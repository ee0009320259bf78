"""The gateway's Serve ingress: ``Gateway`` runs the gRPC server (dmtd.serve.gateway) on its event loop and serves the
OpenAI HTTP routes, the dashboard and health on FastAPI; it follows the registry and Serve's replica counts.
``GatewayIngress`` is the class ``build_app`` (dmtd.serve.app) deploys."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from ray import serve

from dmtd.serve import pod_drain, prefix_router
from dmtd.serve.auth import ApiKeys, server_credentials
from dmtd.serve.binding import bind_serve_internal_grpc
from dmtd.serve.gateway import SERVICE_NAME, GatewayCore, GatewayError, start_grpc_server
from dmtd.serve.openai_api import error_body, install_openapi, model_profile, read_body
from dmtd.serve.openai_models import expand, parse_body
from dmtd.serve.openai_route import OpenAIResponder
from dmtd.serve.push import BlockSink
from dmtd.serve.readiness import DRAIN_DELAY_S, DRAIN_GRACE_S, Readiness, warm_http
from dmtd.serve.requests import InvalidRequest, Limits, TooLarge
from dmtd.serve.routing import Route, Router
from dmtd.telemetry.config import TelemetrySettings, telemetry_settings
from dmtd.telemetry.gateway import GatewayTelemetry
from dmtd.telemetry.logs import configure_json_logging
from dmtd.web import asset_path
from dmtd_contract import metric_names as m
from dmtd_contract.registry import RouteInfo

# no /docs or /redoc: FastAPI's pages load their scripts from a CDN; /openapi.json stays
http_app = FastAPI(title="dmtd gateway", description="OpenAI-compatible API over DMTD replicas", docs_url=None,
                   redoc_url=None)
install_openapi(http_app)
log = logging.getLogger("dmtd.gateway")
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "INTERNAL": 500, "UNAVAILABLE": 503}



class Gateway:
    """Serve ingress: runs the gRPC server on the replica's event loop and serves the OpenAI HTTP routes."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, replicas: dict[str, Any], variants: list[dict[str, Any]], default: str | None = None,
        grpc_host: str = "127.0.0.1", grpc_port: int = 9000, max_inflight: int = 64, registry_url: str | None = None,
        telemetry: dict[str, Any] | None = None, replica_deployments: dict[str, str] | None = None,
        limits: dict[str, Any] | None = None, api_keys_file: str | None = None, tls_cert_file: str | None = None,
        tls_key_file: str | None = None, block_push: str = "auto", http_host: str | None = None,
        http_port: int | None = None,
    ) -> None:
        bind_serve_internal_grpc()
        routes = {v["name"]: Route(v["name"], replicas[v["name"]], RouteInfo.model_validate(v)) for v in variants}
        if telemetry is not None:
            configure_json_logging()
        self.telemetry = GatewayTelemetry(telemetry_settings(telemetry) if telemetry is not None
                                          else TelemetrySettings(metrics_port=None))
        self.sink = await BlockSink(_sink_host(block_push, grpc_host)).start() if block_push != "off" else None
        self.core = GatewayCore(Router(routes, default or (variants[0]["name"] if variants else None)), max_inflight,
                                self.telemetry, Limits(**(limits or {})), self.sink)
        self.keys = ApiKeys.load(api_keys_file)
        self.readiness = await Readiness((SERVICE_NAME, "")).start()  # NOT_SERVING until warm
        self._drained: asyncio.Task[dict[str, Any]] | None = None  # set before anything below can fail
        self.server, self.grpc_port = await start_grpc_server(self.core, grpc_host, grpc_port, self.keys,
                                                              server_credentials(tls_cert_file, tls_key_file),
                                                              self.readiness.health)
        self.replica_deployments = replica_deployments or {}
        self.variant_of = {dep: v for v, dep in self.replica_deployments.items()}
        for v in self.variant_of.values():  # a zero series of each reason from the start
            for reason in prefix_router.REASONS:
                self.telemetry.ins.add(m.ROUTE_DECISIONS_TOTAL, 0, variant=v, reason=reason)
        self._ready_task = asyncio.get_running_loop().create_task(self._follow_replicas())
        self.view: Any = None
        self._syncs: set[asyncio.Task[None]] = set()
        if registry_url:
            from dmtd_contract.registry import RegistryClient, RegistryView

            self.view = RegistryView(RegistryClient(registry_url))
            self.view.add_listener(self._on_registry)
            await self.view.start()
        self.http: Any = None  # the uvicorn server and the task serving it (held: the loop keeps tasks weakly)
        self.http_port: int | None = None
        if http_port is not None:  # last: its routes read this object as Serve's replica context holds it
            server, task, self.http_port = await start_http_server(http_host or grpc_host, http_port,
                                                                    tls_cert_file, tls_key_file)
            self.http = (server, task)
        self._http_base = (None if self.http_port is None else
                           f"{'https' if tls_cert_file else 'http'}://{_loopback(http_host or grpc_host)}:"
                           f"{self.http_port}")
        self._warming = asyncio.get_running_loop().create_task(self.readiness.become_ready(self._warm_all))
        self._drain_watch = pod_drain.watch(self.drain)  # an ingress pod's preStop (dmtd.serve.pod_drain)

    def _on_registry(self, snapshot: Any, change: Any) -> None:
        """Follow the registry: status, canary weight, τ range and default of every served variant; the replicas
        load and let go the variants of their trunk that it activates and retires (their routes follow)."""
        router = self.core.router
        default = snapshot.default_name if hasattr(snapshot, "default_name") else None
        for name in list(router.routes):
            try:
                entry = snapshot.get(name)
            except Exception:
                continue
            router.update(name, RouteInfo.from_entry(entry), snapshot.revision)
        if default in router.routes:
            router.default = default
        task = asyncio.get_running_loop().create_task(self._sync_tails(settle_s=60.0))
        self._syncs.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._syncs.discard)

    async def _sync_tails(self, settle_s: float = 0.0, period_s: float = 0.25, every: bool = False) -> None:
        """Routes to the variants each deployment's replicas serve beside their own, and refusals for those they
        could not load; with ``settle_s``, asked again every ``period_s`` while a load is under way (a registry
        change: its replicas load the new variant within seconds). Only deployments with a running replica are
        asked, unless ``every`` (the warm-up has just reached each)."""
        start = time.monotonic()
        while True:
            loading = False
            for primary, route in list(self.core.router.primaries.items()):
                if not (every or self.telemetry.replicas_ready.get(primary, 0)):
                    continue  # none running: asking would queue the call (and wake a deployment scaled to zero)
                try:
                    report = await asyncio.wait_for(route.handle.served_variants.remote(), 10.0)
                except Exception:
                    continue
                self.core.router.serve_tails(primary, report, self._registry_info)
                loading = loading or bool(report.get("loading"))
            elapsed = time.monotonic() - start  # (a replica may not have begun a load the registry just asked for)
            if elapsed >= settle_s or (not loading and elapsed >= min(settle_s, 2.0)):
                return
            await asyncio.sleep(period_s)

    def _registry_info(self, name: str) -> RouteInfo | None:
        if self.view is None:
            return None
        try:
            return RouteInfo.from_entry(self.view.snapshot.get(name))
        except Exception:
            return None

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
            with contextlib.suppress(Exception):
                await self._sync_tails()
            await asyncio.sleep(period_s if all_up else start_period_s)

    async def warm(self, max_new_tokens: int = 2) -> dict[str, float]:
        """One short request per served variant through the gateway's own path (routing, the Serve handle's first
        call, the block channel, the replica's stream), so that a first client request does not pay them (``dmtd
        serve`` runs it before it says it serves); a plain prompt, which every model serves (one without a chat
        template refuses chat); returns each variant's seconds."""
        from dmtd_contract.records import ReplicaRequest

        out = {}
        for name, route in list(self.core.router.routes.items()):
            t = time.perf_counter()
            req = ReplicaRequest(request_id=f"warm-{uuid.uuid4().hex[:12]}", prompt="Hello!", messages=None,
                                 max_new_tokens=max_new_tokens)
            async for _ in self.core.stream(route, req):
                pass
            out[name] = time.perf_counter() - t
        return out

    async def _warm_all(self) -> dict[str, float]:
        """:meth:`warm`, then one request through the OpenAI route (unless every call needs a key)."""
        out = await self.warm()
        await self._sync_tails(every=True)  # the replicas answered: the variants they serve are listed when ready
        if self._http_base is not None and not self.keys.enabled and self.core.router.routes:
            out["http"] = await asyncio.to_thread(warm_http, self._http_base, "default")  # the default variant
        return out

    async def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Return once ready (dmtd.serve.readiness): its state, with each warm-up's seconds."""
        return await self.readiness.wait(timeout_s)

    async def __del__(self) -> None:
        """Serve's graceful shutdown awaits this (``dmtd serve`` stopping on SIGTERM, a deployment deleted or
        replaced): drain, then the servers are gone."""
        await self.drain()

    async def drain(self, grace_s: float = DRAIN_GRACE_S) -> dict[str, Any]:
        """Stop taking work, let the work in flight finish: probes and gRPC health say not ready at once, new gRPC
        calls are refused (UNAVAILABLE) and new HTTP requests answered 503, the streams in flight (both protocols)
        finish within ``grace_s`` (then the rest are cut); returns the streams found and those cut. Once only: a
        second call (Serve's shutdown after the pod's preStop drained it) waits for the first's result."""
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_task(self._drain(grace_s))
        return await asyncio.shield(self._drained)

    async def _drain(self, grace_s: float) -> dict[str, Any]:
        t = time.monotonic()
        found = self.core.inflight
        await self.readiness.drain(DRAIN_DELAY_S)  # still serving until the probes have seen it
        left_s = max(0.0, grace_s - (time.monotonic() - t))
        stopping = asyncio.get_running_loop().create_task(self.server.stop(left_s))  # refuses new calls now
        while self.core.inflight > 0 and time.monotonic() - t < grace_s:
            await asyncio.sleep(0.05)
        cut = self.core.inflight
        if self.http is not None:
            self.http[0].should_exit = True
        await stopping
        log.info("drained in %.1f s: %d stream(s) in flight, %d cut", time.monotonic() - t, found, cut)
        return {"in_flight": found, "cut": cut, "seconds": time.monotonic() - t}

    async def info(self) -> dict[str, Any]:
        sink = self.sink
        return {"grpc_port": self.grpc_port, "http_port": self.http_port, "pid": os.getpid(),
                "inflight": self.core.inflight, "accepted": self.core.accepted,
                "completed": self.core.completed, "variants": self.core.router.infos(),
                "metrics_url": self.telemetry.metrics_url,
                "block_sink": None if sink is None else {"address": sink.address, "open": sink.num_open,
                                                         "frames": sink.num_frames, "dropped": sink.num_dropped}}

    def on_route_decision(self, deployment: str, reason: str) -> None:
        """A prefix router's decision for one of this gateway's replica deployments (dmtd.serve.prefix_router)."""
        self.telemetry.ins.add(m.ROUTE_DECISIONS_TOTAL, 1, variant=self.variant_of.get(deployment, deployment),
                               reason=reason)

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

    def _not_ready(self) -> JSONResponse | None:
        """503 with Retry-After until the gateway is warm (or while it drains): what probes and clients wait on."""
        if self.readiness.ready:
            return None
        why = "draining" if self.readiness.leaving else "warming up: no request has reached a warm replica yet"
        return JSONResponse(error_body(f"not ready ({why})", "unavailable", code="not_ready"), 503,
                            headers={"Retry-After": "1"})

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (refused := self._refused(request) or self._not_ready()) is not None:
            return refused
        data = [{"id": i["name"], "object": "model", "created": 0, "owned_by": "dmtd", "dmtd": model_profile(i)}
                for i in self.core.router.infos() if i.get("status", "active") == "active"]
        return {"object": "list", "data": data}

    @http_app.get("/healthz")
    async def healthz(self) -> Any:
        """200 once warm (the chart's readiness probe), 503 before and while draining."""
        if not self.readiness.ready:
            status = "draining" if self.readiness.leaving else "warming"
            return JSONResponse({"status": status, **self.readiness.state()}, 503, headers={"Retry-After": "1"})
        return {"status": "ok", "ready_after_s": self.readiness.ready_after_s}

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._openai(request, chat=False)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._openai(request, chat=True)

    async def _openai(self, request: Request, chat: bool) -> Any:
        if (refused := self._refused(request)) is not None:
            return refused
        if self.readiness.draining:
            return self._not_ready()
        try:
            raw = await read_body(request, self.core.limits.max_body_bytes)
            req, body = parse_body(raw, chat, time.time(), self.core.limits)
            route = self.core.admit(body.model if body.model not in ("", "default") else "")
        except InvalidRequest as e:
            self.telemetry.rejected("", "INVALID_ARGUMENT")
            status = 413 if isinstance(e, TooLarge) else 400
            return JSONResponse(error_body(str(e), "invalid_request_error", e.field), status)
        except GatewayError as e:
            return self._error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        responder = OpenAIResponder(self.core, route, body, expand(req, body.n or 1), chat, rid, self._error)
        return await responder.respond(request.headers.get("traceparent"))

    @staticmethod
    def _error(e: GatewayError) -> JSONResponse:
        status = HTTP_STATUS.get(e.code.name, 500)
        headers = {"Retry-After": str(max(1, (e.retry_after_ms or 1000) // 1000))} if status == 429 else None
        kind = "invalid_request_error" if status == 400 else e.code.name.lower()
        # a replica's refusal names the field as the request's API does (ReplicaRequest.field_names)
        return JSONResponse(error_body(str(e), kind, e.field), status, headers=headers)


async def start_http_server(host: str, port: int, cert: str | None = None,
                            key: str | None = None) -> tuple[Any, asyncio.Task[None], int]:
    """The OpenAI routes (``http_app``) on the gateway's own event loop at host:port (0: any free port), TLS with
    ``cert`` / ``key``: a client's request and every streamed chunk go straight between its socket and this process.
    Through Serve's proxy each chunk was a Ray call's item, proxy actor to gateway and back: ~1.2 ms of CPU a token
    across the two processes at 16 streams, against 0.17 for the gRPC server beside this one (AMX Xeon, 2 cores:
    docs/benchmarks.md). Returns the uvicorn server, the task serving it (keep it: the event loop holds tasks only
    weakly) and its bound port; a port that will not bind raises."""
    import socket

    import uvicorn

    # bound here: uvicorn's own bind calls sys.exit when the port is taken
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"http_port: the gateway's HTTP server cannot listen on {host}:{port} ({e.strerror})") from e
    config = uvicorn.Config(http_app, lifespan="off", access_log=False, log_config=None, ssl_certfile=cert,
                            ssl_keyfile=key, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise OSError(f"http_port: the gateway's HTTP server stopped on {host}:{port} as it started")
        await asyncio.sleep(0.01)
    bound = sock.getsockname()[1]
    log.info("HTTP gateway listening on %s:%d (%s)", host, bound, "TLS" if cert else "plaintext")
    return server, task, bound


def _loopback(host: str) -> str:
    """Where this process reaches its own server bound at ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "localhost") else ("[::1]" if host == "::" else host)


def _sink_host(setting: str, grpc_host: str) -> str:
    """The block sink's listening address for a ``block_push`` setting (``ServeConfig.block_push``)."""
    if setting != "auto":
        return setting
    if grpc_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if grpc_host != "::1" else "::1"
    import ray

    return str(ray.util.get_node_ip_address())  # what the replicas on other nodes reach this one by


# Applied at import time, in every process: Serve rewrites the class's routes on this module's app object,
# and replicas import this module afresh rather than unpickling the driver's rewritten app.
GatewayIngress = serve.ingress(http_app)(Gateway)
