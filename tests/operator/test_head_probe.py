"""The head's readiness probe (rendered by the operator), run as the kubelet runs it against real HTTP servers: ready
when the gateway is warm, not while it warms or drains, and, while no gateway listens yet, as Ray's own health says
(KubeRay submits the Serve config only to a Ready head, so a gateway-only probe would never let it start)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dmtd_operator.render import ready_probe_script


@contextmanager
def answering(status: int) -> Iterator[int]:
    """An HTTP server on loopback answering every GET with ``status``; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(gateway: int, raylet: int, gcs: int) -> int:
    script = ready_probe_script(gateway, False, raylet, gcs)
    return subprocess.run([sys.executable, "-c", script], timeout=30).returncode


def test_the_head_is_ready_only_with_a_warm_gateway_or_before_any_gateway_listens():
    with answering(200) as ok, answering(503) as warming, answering(500) as broken:
        nothing = closed_port()
        assert probe(ok, broken, broken) == 0  # the gateway is warm
        assert probe(warming, ok, ok) == 1  # warming or draining: no traffic, whatever Ray says
        assert probe(nothing, ok, ok) == 0  # no gateway yet: Ray's health decides (KubeRay may submit the config)
        assert probe(nothing, ok, broken) == 1 and probe(nothing, nothing, ok) == 1  # and Ray is not healthy
