"""The gateway: a grpc.aio server (``dmtd.v1.GenerateService``, health, reflection) and an OpenAI-compatible
HTTP API, both in front of the DMTD replicas' Serve handles.

Why our own grpc.aio server inside a Serve deployment rather than Serve's gRPC proxy: the proxy serves unary
and server-streaming methods only (no server reflection, no ``grpc.health.v1`` of ours), maps errors to a
fixed set of codes and has no hook for a retry hint on ``RESOURCE_EXHAUSTED``. Hosting the server in the
``Gateway`` deployment keeps Serve's lifecycle (health checks, restarts, handles to replicas with
cancellation propagation) and gives us the whole gRPC surface. See docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dmtd.serve.convert import rechunk, to_token_block, to_variant_info
from dmtd.serve.replica import Overloaded, RequestFailed
from dmtd.serve.requests import InvalidRequest, ReplicaRequest, from_proto
from dmtd.serve.routing import Route, Router, VariantNotFound
from dmtd.telemetry.config import TelemetrySettings
from dmtd.telemetry.gateway import GatewayTelemetry, RequestTelemetry
from dmtd.v1 import generate_pb2 as pb
from dmtd.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger("dmtd.gateway")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name


class GatewayError(Exception):
    """A request-level failure with the gRPC status it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code, self.retry_after_ms = code, retry_after_ms


def _unavailable_types() -> tuple[type[BaseException], ...]:
    from ray import exceptions as rex

    return tuple(t for t in (getattr(rex, "RayActorError", None), getattr(rex, "ActorUnavailableError", None),
                             getattr(rex, "ActorDiedError", None)) if t is not None)


class GatewayCore:
    """Routing, admission (bounded in-flight), streaming and error mapping shared by gRPC and HTTP."""

    def __init__(self, router: Router, max_inflight: int, telemetry: GatewayTelemetry | None = None) -> None:
        self.router, self.max_inflight = router, max_inflight
        self.telemetry = telemetry or GatewayTelemetry(TelemetrySettings(metrics_port=None))
        self.inflight = 0
        self.accepted = 0
        self.completed = 0

    def admit(self, variant: str) -> Route:
        try:
            route = self.router.resolve(variant)
        except VariantNotFound as e:
            self.telemetry.rejected(variant, grpc.StatusCode.NOT_FOUND.name)
            raise GatewayError(grpc.StatusCode.NOT_FOUND, str(e)) from e
        if self.inflight >= self.max_inflight:
            self.telemetry.rejected(route.name, grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gateway at capacity ({self.max_inflight} streams in flight); retry later", 250)
        return route

    async def stream(self, route: Route, req: ReplicaRequest, min_tokens: int = 0, flush_ms: int = 0,
                     traceparent: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Blocks of one request from its replica; cancelling this iteration cancels the replica's work.

        The gateway span (child of ``traceparent`` when the caller sent one) travels to the replica in the
        request dict; TTFT and per-token ITL are measured on the blocks as the client receives them."""
        self.inflight += 1
        self.accepted += 1
        rt = self.telemetry.start(route.name, req.request_id, traceparent,
                                  {"dmtd.max_new_tokens": req.max_new_tokens})
        req.traceparent = rt.traceparent
        finished = False
        code, error = "CANCELLED", None
        gen: Any = None
        try:
            gen = route.handle.options(stream=True).generate.remote(req.to_dict())
            async for block in rechunk(self._cycles(gen, rt), min_tokens, flush_ms):
                finished = bool(block.get("finish_reason"))
                rt.delivered(len(block["token_ids"]))
                yield block
            self.completed += 1
            code = "OK"
        except Exception as raw:
            mapped = self._map_error(route, raw)
            code, error = mapped.code.name if isinstance(mapped, GatewayError) else "INTERNAL", str(mapped)
            raise mapped from raw
        finally:
            self.inflight -= 1
            rt.finish(code, error)
            if not finished and gen is not None:
                gen.cancel()

    @staticmethod
    async def _cycles(gen: Any, rt: RequestTelemetry) -> AsyncIterator[dict[str, Any]]:
        """The replica's blocks as they arrive (one per DMTD cycle), counted before any re-chunking."""
        async for block in gen:
            rt.cycle(block["k"], block["tau"], block.get("replica", ""))
            yield block


    @staticmethod
    def _map_error(route: Route, raw: Exception) -> Exception:
        """Replica-side exceptions (Ray wraps them in RayTaskError) → the gRPC status they mean."""
        e: BaseException = getattr(raw, "cause", None) or raw
        if isinstance(e, GatewayError):
            return e
        if isinstance(e, Overloaded):
            return GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_ms)
        if isinstance(e, RequestFailed):
            return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if isinstance(raw, _unavailable_types()) or isinstance(e, _unavailable_types()):
            msg = f"replica of {route.name!r} went away ({type(e).__name__})"
            return GatewayError(grpc.StatusCode.UNAVAILABLE, msg)
        log.exception("request failed", exc_info=raw)
        return GatewayError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 — gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenBlock]:
        arrival = time.time()
        t0 = time.perf_counter()
        try:
            req = from_proto(request, arrival)
            route = self.core.admit(request.variant)
        except InvalidRequest as e:
            self.core.telemetry.rejected(request.variant, grpc.StatusCode.INVALID_ARGUMENT.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        except GatewayError as e:
            await self._abort(context, e)
            return
        first = True
        try:
            parent = dict(context.invocation_metadata() or ()).get("traceparent")
            async for block in self.core.stream(route, req, request.min_block_tokens, request.flush_interval_ms,
                                                str(parent) if parent else None):
                ttft = (time.perf_counter() - t0) * 1e3 if first else None
                first = False
                yield to_token_block(block, route.name, ttft)
        except GatewayError as e:
            await self._abort(context, e)

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, e: GatewayError) -> None:
        if e.retry_after_ms is not None:
            context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
        await context.abort(e.code, str(e))

    async def ListVariants(self, request: pb.ListVariantsRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ListVariantsResponse:
        return pb.ListVariantsResponse(variants=[to_variant_info(i) for i in self.core.router.infos()],
                                       registry_revision=self.core.router.revision)

    async def GetVariant(self, request: pb.GetVariantRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.VariantInfo:
        for info in self.core.router.infos():
            if info["name"] == request.name:
                return to_variant_info(info)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"variant {request.name!r} not found")
        raise AssertionError("unreachable")


async def start_grpc_server(core: GatewayCore, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve GenerateService + grpc.health.v1 + reflection on host:port (0 = any free port)."""
    server = grpc.aio.server()
    pb_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    log.info("gRPC gateway listening on %s:%d", host, bound)
    return server, bound
