"""Ready means warm, at every probe: the gateway's ``/healthz``, ``/v1/models`` and ``grpc.health.v1`` say
NOT ready until a request has gone through the gateway's own path to a running (hence warm: dmtd.serve.warmup)
replica of every served variant, and through its OpenAI route; then ready; and not ready again while it drains.

A load balancer, the chart's readiness probe or a client polling ``/v1/models`` sees what a first request would
get: before this gate the HTTP server answered 200 about 12 s after start while the replicas were still building
and warming, and a chat request sent then waited 8-9.5 s against a steady 50-160 ms.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from grpc_health.v1 import health, health_pb2

log = logging.getLogger("dmtd.gateway")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DRAIN_GRACE_S = float(os.environ.get("DMTD_DRAIN_GRACE_S", "30"))
"""How long a draining gateway lets its streams in flight finish (Serve's graceful shutdown waits a little longer)."""
DRAIN_DELAY_S = float(os.environ.get("DMTD_DRAIN_DELAY_S", "0"))
"""How long a draining gateway, already not ready, still takes new work: until the load balancer's probe has seen it
(an ingress pod: the readiness probe's period and a margin), so that no client it still sends there is refused."""


class Readiness:
    """The gateway's readiness: one flag behind its HTTP probes and its gRPC health service (``health``)."""

    def __init__(self, services: tuple[str, ...] = ("",)) -> None:
        self.health = health.aio.HealthServicer()
        self.services = services
        self.started_s = time.monotonic()
        self.ready_after_s: float | None = None  # seconds from construction to ready; None until then
        self.leaving = False  # not ready for good: a drain began
        self.draining = False  # new work refused (``leaving``, and its delay is over)
        self.warm_s: dict[str, float] = {}
        self._event = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self._event.is_set() and not self.leaving

    async def start(self) -> Readiness:
        """Every service NOT_SERVING (call before the gRPC server starts)."""
        await self._set(NOT_SERVING)
        return self

    async def become_ready(self, warm: Callable[[], Awaitable[dict[str, float]]], retry_s: float = 2.0) -> None:
        """Run ``warm`` (returns each variant's warm-up seconds) until it succeeds, then report ready. A failure
        (no replica yet, a replica that died while warming) is logged and retried: the probes keep saying no."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self.warm_s = await warm()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 — retried until a replica answers; the probes say why not
                log.warning("warm-up attempt %d failed (%s: %s); still not ready", attempt, type(e).__name__, e)
                await asyncio.sleep(retry_s)
        self.ready_after_s = time.monotonic() - self.started_s
        self._event.set()
        if not self.leaving:
            await self._set(SERVING)
        log.info("ready after %.1f s (warm-up %s)", self.ready_after_s,
                 ", ".join(f"{k} {v:.2f} s" for k, v in self.warm_s.items()))

    async def drain(self, delay_s: float = 0.0) -> None:
        """Not ready from now on (a SIGTERM, a shutdown): probes send new clients elsewhere; streams go on. New work
        is still taken for ``delay_s``, while a load balancer's probe has not yet seen the change; then ``draining``."""
        self.leaving = True
        await self._set(NOT_SERVING)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        self.draining = True

    async def wait(self, timeout_s: float) -> dict[str, Any]:
        """Wait until ready (``TimeoutError`` after ``timeout_s``); returns :meth:`state`."""
        await asyncio.wait_for(self._event.wait(), timeout_s)
        return self.state()

    def state(self) -> dict[str, Any]:
        return {"ready": self.ready, "draining": self.leaving, "ready_after_s": self.ready_after_s,
                "warm_s": dict(self.warm_s)}

    async def _set(self, status: Any) -> None:
        for service in self.services:
            await self.health.set(service, status)


def warm_http(base: str, model: str, timeout_s: float = 120.0) -> float:
    """One short streamed completion through the OpenAI route at ``base`` (the route's first call: body parsing,
    the responder, the SSE writer; a completion, which every model serves — one without a chat template refuses
    chat); returns its seconds. Raises ``OSError`` when it fails."""
    import json
    import ssl
    import urllib.request

    body = json.dumps({"model": model, "prompt": "Hello!", "max_tokens": 2, "stream": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    ctx = ssl._create_unverified_context() if base.startswith("https") else None  # our own loopback
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
        resp.read()
    return time.perf_counter() - t
