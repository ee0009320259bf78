"""The gateway: a grpc.aio server (``dmtd.v1.GenerateService``, health, reflection) and an OpenAI-compatible
HTTP API, both in front of the DMTD replicas' Serve handles.

Why our own grpc.aio server inside a Serve deployment rather than Serve's gRPC proxy: the proxy serves unary
and server-streaming methods only (no server reflection, no ``grpc.health.v1`` of ours), maps errors to a
fixed set of codes and has no hook for a retry hint on ``RESOURCE_EXHAUSTED``. Hosting the server in the
``Gateway`` deployment keeps Serve's lifecycle (health checks, restarts, handles to replicas with
cancellation propagation) and gives us the whole gRPC surface. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dmtd.serve.auth import ApiKeys, AuthInterceptor
from dmtd.serve.convert import merge_blocks, rechunk, to_token_block, to_variant_info
from dmtd.serve.errors import Overloaded, ReplicaInternalError, RequestFailed, VariantUnavailable
from dmtd.serve.push import BlockSink
from dmtd.serve.requests import InvalidRequest, Limits, TooLarge, from_proto
from dmtd.serve.routing import Route, Router
from dmtd.telemetry.config import TelemetrySettings
from dmtd.telemetry.gateway import GatewayTelemetry, RequestTelemetry
from dmtd.v1 import generate_pb2 as pb
from dmtd_contract.records import Block, ReplicaRequest
from dmtd_contract.registry import VariantNotFound

log = logging.getLogger("dmtd.gateway")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name


class GatewayError(Exception):
    """A request-level failure with the gRPC status it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.retry_after_ms, self.field = code, retry_after_ms, field


def _unavailable_types() -> tuple[type[BaseException], ...]:
    from ray import exceptions as rex

    return tuple(t for t in (getattr(rex, "RayActorError", None), getattr(rex, "ActorUnavailableError", None),
                             getattr(rex, "ActorDiedError", None)) if t is not None)


class GatewayCore:
    """Routing, admission (bounded in-flight), streaming and error mapping shared by gRPC and HTTP."""

    def __init__(self, router: Router, max_inflight: int, telemetry: GatewayTelemetry | None = None,
                 limits: Limits | None = None, sink: BlockSink | None = None, push_grace_s: float = 10.0) -> None:
        self.router, self.max_inflight = router, max_inflight
        self.sink, self.push_grace_s = sink, push_grace_s
        self._pumps: set[asyncio.Task[None]] = set()
        self.limits = limits or Limits()
        self.telemetry = telemetry or GatewayTelemetry(TelemetrySettings(metrics_port=None))
        self.inflight = 0
        self.accepted = 0
        self.completed = 0

    def label(self, variant: str) -> str:
        """A metric label for a client-supplied variant name: served variants by name, others ``unknown``."""
        return variant if not variant or variant in self.router.routes else "unknown"

    def admit(self, variant: str) -> Route:
        try:
            route = self.router.resolve(variant)
        except VariantNotFound as e:
            self.telemetry.rejected(self.label(variant), grpc.StatusCode.NOT_FOUND.name)
            raise GatewayError(grpc.StatusCode.NOT_FOUND, str(e)) from e
        if self.inflight >= self.max_inflight:
            self.telemetry.rejected(route.name, grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gateway at capacity ({self.max_inflight} streams in flight); retry later", 250)
        return route

    async def stream(self, route: Route, req: ReplicaRequest, min_tokens: int = 0, flush_ms: int = 0,
                     traceparent: str | None = None) -> AsyncIterator[Block]:
        """Blocks of one request from its replica; cancelling this iteration cancels the replica's work.

        The gateway span (child of ``traceparent`` when the caller sent one) travels to the replica in the
        request; TTFT and per-token ITL are measured on the blocks as the client receives them."""
        self.inflight += 1
        self.accepted += 1
        req.variant = route.name  # which of its replicas' variants runs it (their own, or a tail)
        rt = self.telemetry.start(route.name, req.request_id, traceparent,
                                  {"dmtd.max_new_tokens": req.max_new_tokens})
        req.traceparent = rt.traceparent
        finished = False
        code, error = "CANCELLED", None
        gen: Any = None
        token, queue = self.sink.open() if self.sink is not None else ("", None)
        if queue is not None:
            req.push_to, req.push_token = self.sink.address, token  # type: ignore[union-attr]
        try:
            req.sent_s = time.time()
            if req.arrival_s:
                rt.stage("gateway_receive", max(0.0, (req.sent_s - req.arrival_s) * 1e3))
            gen = route.handle.options(stream=True).generate_batches.remote(req)
            source = gen if queue is None else self._pushed(gen, queue)
            async for block in rechunk(self._cycles(source, rt), min_tokens, flush_ms):
                finished = bool(block.finish_reason)
                rt.delivered(len(block.token_ids))
                t = time.perf_counter()
                yield block
                rt.stage("client_write", (time.perf_counter() - t) * 1e3)
            self.completed += 1
            code = "OK"
        except Exception as raw:
            mapped = self._map_error(route, raw)
            code, error = mapped.code.name if isinstance(mapped, GatewayError) else "INTERNAL", str(mapped)
            raise mapped from raw
        finally:
            self.inflight -= 1
            rt.finish(code, error)
            if token:
                self.sink.close(token)  # type: ignore[union-attr]
            if not finished and gen is not None:
                gen.cancel()

    async def _pushed(self, gen: Any, queue: asyncio.Queue[Any]) -> AsyncIterator[list[Block]]:
        """A pushed request's blocks: the sink's frames, merged with what the Serve call itself brings (its
        errors, its end, blocks streamed through it when the replica cannot reach the sink). Blocks come in
        order or the stream fails: a lost frame is an error, never a silent gap in the tokens."""
        task = asyncio.get_running_loop().create_task(_pump(gen, queue))
        self._pumps.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._pumps.discard)
        next_index, call_ended, done = 0, False, False
        try:
            while True:
                if call_ended:  # the replica has sent everything: its last frame is at most in flight
                    try:
                        item = await asyncio.wait_for(queue.get(), self.push_grace_s)
                    except TimeoutError:
                        raise ReplicaInternalError(f"the replica's stream ended at block {next_index} without "
                                                   "its last block") from None
                else:
                    item = await queue.get()
                if item is _CALL_ENDED:
                    call_ended = True
                    continue
                if isinstance(item, BaseException):
                    raise item
                for b in item:
                    if b.block_index != next_index:
                        raise ReplicaInternalError(f"block {next_index} of the stream was lost "
                                                   f"(block {b.block_index} came next)")
                    next_index += 1
                yield item
                if item and item[-1].finish_reason:
                    done = True
                    return
        finally:
            if not done:
                task.cancel()

    @staticmethod
    async def _cycles(gen: Any, rt: RequestTelemetry) -> AsyncIterator[Block]:
        """The replica's blocks, counted one by one (one per DMTD cycle), then each pushed frame or streamed item
        (the blocks that became ready within the replica's stream interval) as one merged block: one message to
        the client per interval, not one per cycle (docs/serving.md, "The stream interval")."""
        async for batch in gen:
            arrived = time.time()
            for block in batch:
                if block.sent_s:
                    rt.stage("ray_hop", max(0.0, (arrived - block.sent_s) * 1e3))
                rt.stage("engine_step", block.step_ms)
                rt.stage("engine_step_cpu", block.step_cpu_ms)
                rt.stage("dispatch", block.dispatch_ms)
                rt.cycle(block.k, block.tau, block.replica, block.num_drafted, block.num_accepted)
            yield merge_blocks(batch)


    @staticmethod
    def _map_error(route: Route, raw: Exception) -> Exception:
        """Replica-side exceptions (Ray wraps them in RayTaskError) → the gRPC status they mean."""
        e: BaseException = getattr(raw, "cause", None) or raw
        if isinstance(e, GatewayError):
            return e
        if isinstance(e, Overloaded):
            return GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_ms)
        if isinstance(e, RequestFailed):
            return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e), field=e.field)
        if isinstance(e, VariantUnavailable):
            return GatewayError(grpc.StatusCode.NOT_FOUND, str(e), field="model")
        if isinstance(e, ReplicaInternalError):
            return GatewayError(grpc.StatusCode.INTERNAL, f"internal error: {e}")
        if isinstance(raw, _unavailable_types()) or isinstance(e, _unavailable_types()):
            msg = f"replica of {route.name!r} went away ({type(e).__name__})"
            return GatewayError(grpc.StatusCode.UNAVAILABLE, msg)
        error_id = uuid.uuid4().hex[:16]
        log.error("request failed [error id %s]", error_id, exc_info=raw)
        return GatewayError(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}) (error id {error_id})")


_CALL_ENDED = object()


async def _pump(gen: Any, queue: asyncio.Queue[Any]) -> None:
    """Feed the Serve call's items, then its end or its error, into a pushed request's queue."""
    try:
        async for batch in gen:
            queue.put_nowait(batch)
    except Exception as e:
        queue.put_nowait(e)
    else:
        queue.put_nowait(_CALL_ENDED)


def decode(cls: type[Message], raw: bytes, max_bytes: int) -> Any:
    """Parse a serialized request; a corrupt or oversized one is :class:`InvalidRequest`, not UNKNOWN."""
    if len(raw) > max_bytes:
        raise TooLarge("request", f"at most {max_bytes} bytes serialized, got {len(raw)}")
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        raise InvalidRequest("request", f"not a valid {cls.DESCRIPTOR.full_name} ({e}; strings must be "
                                        "UTF-8)") from e


class GenerateServicer:
    """``dmtd.v1.GenerateService``; requests arrive as bytes so that decoding errors are ours to report."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def _decode(self, cls: type[Message], raw: bytes) -> Any:
        return decode(cls, raw, self.core.limits.max_body_bytes)

    async def Generate(self, raw: bytes,  # noqa: N802 — gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenBlock]:
        arrival = time.time()
        t0 = time.perf_counter()
        variant = ""
        try:
            request = self._decode(pb.GenerateRequest, raw)
            variant = request.variant
            req = from_proto(request, arrival, self.core.limits)
            route = self.core.admit(request.variant)
        except InvalidRequest as e:
            self.core.telemetry.rejected(self.core.label(variant), grpc.StatusCode.INVALID_ARGUMENT.name)
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

    async def ListVariants(self, raw: bytes,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ListVariantsResponse:
        try:
            self._decode(pb.ListVariantsRequest, raw)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ListVariantsResponse(variants=[to_variant_info(i) for i in self.core.router.infos()],
                                       registry_revision=self.core.router.revision)

    async def GetVariant(self, raw: bytes,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.VariantInfo:
        try:
            request = self._decode(pb.GetVariantRequest, raw)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for info in self.core.router.infos():
            if info["name"] == request.name:
                return to_variant_info(info)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"variant {request.name!r} not found")
        raise AssertionError("unreachable")


def _service_handler(servicer: GenerateServicer) -> grpc.GenericRpcHandler:
    methods = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, response_serializer=pb.TokenBlock.SerializeToString),
        "ListVariants": grpc.unary_unary_rpc_method_handler(
            servicer.ListVariants, response_serializer=pb.ListVariantsResponse.SerializeToString),
        "GetVariant": grpc.unary_unary_rpc_method_handler(
            servicer.GetVariant, response_serializer=pb.VariantInfo.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)


async def start_grpc_server(core: GatewayCore, host: str, port: int, keys: ApiKeys | None = None,
                            credentials: grpc.ServerCredentials | None = None,
                            health_servicer: health.aio.HealthServicer | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve GenerateService + grpc.health.v1 + reflection on host:port (0 = any free port); with ``keys``,
    every call but the health checks needs one; with ``credentials``, TLS. The health service is
    ``health_servicer`` as its owner sets it (dmtd.serve.readiness), else one that says SERVING."""
    # gRPC's own limit sits above ours, so that most oversized requests get our INVALID_ARGUMENT
    max_bytes = max(4 << 20, 4 * core.limits.max_body_bytes)
    interceptors = [AuthInterceptor(keys)] if keys is not None and keys.enabled else []
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.max_receive_message_length", max_bytes)])
    server.add_generic_rpc_handlers((_service_handler(GenerateServicer(core)),))
    if health_servicer is None:
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    log.info("gRPC gateway listening on %s:%d (%s, %s)", host, bound, "TLS" if credentials else "plaintext",
             "API keys" if interceptors else "no authentication")
    return server, bound
