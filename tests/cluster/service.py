"""The gateway Service as kube-proxy serves it, for clients that know one address only: a TCP proxy in this test's
network namespace that sends each new connection to one of the Service's *ready* endpoints, picked at random
(kube-proxy's iptables mode), and refuses it (closes it at once) when none is ready. An endpoint is ready while its
pod's readiness probe passes — the ingress pods' probe, the gateway's ``/healthz`` every 2 s, one failure enough
(dmtd_operator.render.ingress_probe) — and leaves the moment its pod is deleted (a terminating pod's endpoint is no
longer ready). Connections already open stay where they are, as with kube-proxy: a gRPC client moves only when its
connection closes (the gateway's GOAWAY on drain)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from dmtd_operator.resources import GATEWAY_GRPC_PORT, GATEWAY_HTTP_PORT

PROBE_PERIOD_S = 2.0


@dataclass
class ServiceProxy:
    """Listens on ``127.0.0.1:<port>``; ``add`` / ``delete`` pod addresses as the Service's selector matches them."""

    port: int = 0
    endpoints: set[str] = field(default_factory=set)  # pod addresses the selector matches (not terminating)
    ready: set[str] = field(default_factory=set)
    connections: dict[str, int] = field(default_factory=dict)  # connections sent to each address
    refused: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add(self, *ips: str) -> None:
        with self._lock:
            self.endpoints.update(ips)

    def delete(self, *ips: str) -> None:
        """The pods are deleted: their endpoints leave at once (new connections go elsewhere)."""
        with self._lock:
            self.endpoints.difference_update(ips)
            self.ready.difference_update(ips)

    def start(self) -> ServiceProxy:
        started = threading.Event()
        serve = threading.Thread(target=self._serve, args=(started,), daemon=True)
        probe = threading.Thread(target=self._probe, daemon=True)
        self._threads = [serve, probe]
        serve.start()
        started.wait(10)
        probe.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        for t in self._threads:
            t.join(10)

    def wait_ready(self, ips: set[str], timeout_s: float) -> float:
        """Seconds until every one of ``ips`` is a ready endpoint."""
        t0 = time.monotonic()
        while not ips <= self.ready:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"endpoints {sorted(ips - self.ready)} not ready after {timeout_s} s")
            time.sleep(0.2)
        return time.monotonic() - t0

    def _probe(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pods = set(self.endpoints)
            for ip in pods:
                try:
                    with urllib.request.urlopen(f"http://{ip}:{GATEWAY_HTTP_PORT}/healthz", timeout=2) as resp:
                        ok = resp.status == 200
                except OSError:
                    ok = False
                with self._lock:
                    if ok and ip in self.endpoints:
                        self.ready.add(ip)
                    else:
                        self.ready.discard(ip)
            self._stop.wait(PROBE_PERIOD_S)

    def _serve(self, started: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        loop.run_forever()
        server.close()
        loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            choices = sorted(self.ready)
        if not choices:
            self.refused += 1
            writer.close()
            return
        ip = random.choice(choices)
        self.connections[ip] = self.connections.get(ip, 0) + 1
        try:
            up_reader, up_writer = await asyncio.open_connection(ip, GATEWAY_GRPC_PORT)
        except OSError:
            self.refused += 1
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
