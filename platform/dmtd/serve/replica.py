"""A DMTD replica: one engine, an asyncio loop driving continuous batching, one block per cycle per request.

``DMTDReplica`` is a plain class (the app builder wraps it with ``serve.deployment``), so tests construct it
directly with a small engine. The engine is not thread-safe: only its one executor thread touches it, taking its
jobs itself back to back (``engine_loop.EngineLoop``), while the event loop stages requests for it and delivers
the blocks of each finished step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from dmtd.engine.llm import LLMEngine
from dmtd.serve.binding import bind_serve_internal_grpc
from dmtd.serve.controller import ControllerConfig, TauController
from dmtd.serve.engine_loop import EngineLoop, engine_executor
from dmtd.serve.errors import Overloaded, RequestFailed
from dmtd.serve.push import BlockPusher, PushUnavailable
from dmtd.serve.replica_variants import ReplicaVariants
from dmtd.serve.requests import InvalidRequest, Limits, check_types, validate
from dmtd.serve.warmup import warm_up
from dmtd.telemetry.config import TelemetrySettings, telemetry_settings
from dmtd.telemetry.logs import configure_json_logging
from dmtd.telemetry.replica import ReplicaTelemetry
from dmtd_contract.records import Block, ReplicaRequest

__all__ = ["DMTDReplica", "EngineFactory", "EngineLoop", "Overloaded", "RequestFailed"]
log = logging.getLogger("dmtd.replica")


EngineFactory = Callable[[], tuple[LLMEngine, ControllerConfig]]


class DMTDReplica:
    """Hosts one engine. ``generate`` takes a ``ReplicaRequest`` and is an async generator of ``Block`` records
    (dmtd_contract.records; one per completed cycle).

    With a registry URL, the replica follows its variant's registry entry: a changed ``min_confidence``,
    τ range or ``default_tau`` is applied to the controller (and to running requests) without a restart, a
    changed ``default_profile`` to the requests that arrive after it.
    """

    def __init__(self, engine_factory: EngineFactory, max_queued: int = 64, name: str | None = None,
                 registry_url: str | None = None, variant: str | None = None,
                 telemetry: dict[str, Any] | None = None, limits: dict[str, Any] | None = None,
                 stream_interval_ms: float = 0.0, tails: list[str] | None = None, max_variants: int = 8) -> None:
        bind_serve_internal_grpc()
        if not 0.0 <= float(stream_interval_ms) <= 1000.0:
            raise ValueError(f"stream_interval_ms: must be within 0..1000 ms, got {stream_interval_ms!r}")
        self.stream_interval_ms = float(stream_interval_ms)
        self.pusher = BlockPusher()
        self.limits = Limits(**(limits or {}))  # the gateway's: a request it let through passes here too
        executor = engine_executor()  # the engine is built, and only ever run, on this one thread (engine_loop)
        engine, cfg = executor.submit(engine_factory).result()
        # unique across nodes: a pid alone is not (replicas started alike in containers of one image got the same)
        self.name = name or f"replica-{socket.gethostname()}-{os.getpid()}"
        # the other variants of its trunk: its arguments' and, with a registry, every active one, loaded before it is
        # ready (a new or restarted replica serves the whole set from its first request)
        self.variants = ReplicaVariants(variant or "default", getattr(engine_factory, "trunk", None), max_variants,
                                        self.name)
        self._registered: set[str] = set()  # loaded because the registry names them
        self.variants.registry = _registry_client(registry_url)
        for source in tails or []:
            self.variants.load_now(executor, engine, source)
        if self.variants.registry is not None:
            with contextlib.suppress(Exception):  # unavailable: its own variant and its arguments' serve
                for vname, source in self.variants.desired(self.variants.registry.snapshot()).items():
                    self._registered.add(vname)
                    self.variants.load_now(executor, engine, source, vname)
        # ready means warm: Serve routes to a replica once this constructor returns
        self.warmup_s = executor.submit(warm_up, engine, cfg.tau_max, cfg.default_profile).result()
        self.loop = EngineLoop(engine, TauController(cfg), max_queued, self.name, executor=executor)
        self.loop.pusher = self.pusher
        self.variants.loop = self.loop
        if telemetry is not None:  # built by the app: JSON logs, a Prometheus endpoint, the configured exporter
            configure_json_logging()
            settings = telemetry_settings(telemetry)
        else:
            settings = TelemetrySettings(metrics_port=None)
        self.telemetry = ReplicaTelemetry(settings, self.name, variant or "default", self.loop.state)
        self.loop.telemetry = self.telemetry
        self.registry_url, self.variant = registry_url, variant
        self._view: Any = None
        self.registry_revision = 0
        with contextlib.suppress(RuntimeError):  # Serve builds us on its event loop; plain tests do not
            asyncio.get_running_loop().create_task(self.follow_registry())

    async def follow_registry(self) -> None:
        """Subscribe to the registry and apply this variant's tunables on every change."""
        if not self.registry_url or not self.variant or self._view is not None:
            return
        from dmtd_contract.registry import RegistryClient, RegistryView

        self._view = RegistryView(RegistryClient(self.registry_url))
        self._view.add_listener(self._on_registry)
        try:
            await self._view.start()
        except Exception:
            log.exception("replica %s: registry %s unavailable; serving with local settings", self.name,
                          self.registry_url)

    def _on_registry(self, snapshot: Any, change: Any) -> None:
        self.variants.follow(snapshot, self._registered)
        try:
            entry = snapshot.get(self.variant)
        except Exception:
            return
        self.registry_revision = snapshot.revision
        self.reconfigure({"tau_min": entry.tau_min, "tau_max": entry.tau_max, "default_tau": entry.default_tau,
                          "min_confidence": entry.min_confidence, "default_profile": entry.default_profile})

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Block]:
        """The request's blocks, one by one, as soon as each is ready."""
        async with contextlib.aclosing(self._blocks(request, 0.0)) as batches:  # closing us closes it at once
            async for batch in batches:
                for block in batch:
                    yield block

    async def generate_batches(self, request: ReplicaRequest) -> AsyncIterator[list[Block]]:
        """The request's blocks in lists, at most one list per ``stream_interval_ms`` after the first (what the
        gateway streams: one Ray item carries every block that became ready in the interval).

        A request that names a block sink (``push_to``, ``push_token``: dmtd.serve.push) has its blocks pushed
        there, in frames of one stream interval likewise, and this stream yields nothing unless the sink cannot be
        reached: then the rest of the blocks come as items here, as above. Errors are raised here either way."""
        async with contextlib.aclosing(self._blocks(request, self.stream_interval_ms, push=True)) as batches:
            async for batch in batches:
                yield batch

    async def _blocks(self, request: ReplicaRequest, interval_ms: float,
                      push: bool = False) -> AsyncGenerator[list[Block], None]:
        # aclosing: a consumer that stops early (client cancel) closes submit() now, freeing the slot
        if not isinstance(request, ReplicaRequest):
            raise RequestFailed("request", f"request: not a replica request (got {type(request).__name__})")
        try:
            req = validate(check_types(request), self.limits)
        except InvalidRequest as e:
            raise RequestFailed(e.field, str(e)) from e
        served = self.variants.admit(req)  # VariantUnavailable (NOT_FOUND) unless served here
        if served is None:
            req.profile = self.loop.controller.cfg.profile_of(req.profile)
        try:
            async with contextlib.aclosing(self._run(req, interval_ms, push)) as batches:
                async for batch in batches:
                    yield batch
        finally:
            self.variants.release(served)

    async def _run(self, req: ReplicaRequest, interval_ms: float, push: bool) -> AsyncGenerator[list[Block], None]:
        target = None
        if push and req.push_to:  # the engine loop writes its blocks to the gateway's sink
            try:
                await self.pusher.connect(req.push_to)
                target = (req.push_to, req.push_token)
            except PushUnavailable as e:
                log.warning("replica %s: %s; streaming request %s through Serve", self.name, e, req.request_id)
        async with contextlib.aclosing(self.loop.submit(req, interval_ms, target)) as batches:
            async for batch in batches:
                yield batch

    async def metrics_url(self) -> str | None:
        """Where this replica's Prometheus endpoint listens (None: not served)."""
        return self.telemetry.metrics_url

    async def finished_spans(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        """Finished spans held by the in-memory exporter (all, or one trace's)."""
        return self.telemetry.finished_spans(trace_id)

    async def served_variants(self) -> dict[str, Any]:
        """The variants this replica serves (its own first), each loaded one's bytes and load time, and the refused
        ones with why (the gateway routes by it)."""
        return self.variants.set.report()

    async def load_variant(self, source: str) -> dict[str, Any]:
        """Load another variant of this replica's trunk now (a manifest path or shipped name); the report after."""
        await self.variants.load(source)
        return self.variants.set.report()

    async def unload_variant(self, name: str) -> dict[str, Any]:
        """Let a loaded variant go (after its requests in flight); the report after."""
        await self.variants.unload(name)
        return self.variants.set.report()

    async def stats(self) -> dict[str, Any]:
        await self.follow_registry()
        return {**self.loop.stats(), "registry_revision": self.registry_revision,
                "tau_bounds": (self.loop.controller.cfg.tau_min, self.loop.controller.cfg.tau_max),
                "rest_min_confidence": self.loop.controller.cfg.rest_min_confidence,
                "default_profile": self.loop.controller.cfg.default_profile,
                "metrics_url": self.telemetry.metrics_url, "warmup_s": self.warmup_s,
                "variants": self.variants.set.report()}

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve ``user_config``: τ bounds and gate from the operator or the registry; no restart."""
        c = self.loop.controller.cfg
        new = ControllerConfig(
            tau_min=int(user_config.get("tau_min", c.tau_min)), tau_max=int(user_config.get("tau_max", c.tau_max)),
            rest_tau=int(user_config.get("default_tau", c.rest_tau)),
            rest_min_confidence=float(user_config.get("min_confidence", c.rest_min_confidence)),
            pressure_min_confidence=float(user_config.get("pressure_min_confidence", c.pressure_min_confidence)),
            itl_slo_ms=float(user_config.get("itl_slo_ms", c.itl_slo_ms)), max_batch=c.max_batch,
            window=c.window, hold_steps=c.hold_steps,
            default_profile=str(user_config.get("default_profile", c.default_profile)),
        )
        variant_max = self.loop.engine.dmtd.tau_max
        new.tau_max = max(1, min(new.tau_max, variant_max))
        new.tau_min = max(1, min(new.tau_min, new.tau_max))
        self.loop.reconfigure(new)
        d = self.loop.controller.decision  # the operating point moves at once when there is no pressure
        if self.loop.controller.queue_depth == 0:
            self.loop.controller.decision = type(d)(new.clamp(new.rest_tau), new.rest_min_confidence,
                                                    "reconfigured: new operating point")
        self.loop.apply_decision()


def _registry_client(url: str | None) -> Any:
    """A client of the registry at ``url`` (None: none; one that cannot be made is logged, not fatal)."""
    if not url:
        return None
    try:
        from dmtd_contract.registry import RegistryClient

        return RegistryClient(url)
    except Exception:
        log.exception("registry %s unavailable", url)
        return None
