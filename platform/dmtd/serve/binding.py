"""Keep Ray Serve's per-replica inter-deployment gRPC server on one address.

Ray Serve (2.60) binds that server to ``[::]:0`` in every replica process, whatever the node's address.
``dmtd serve`` runs the whole stack on one machine, so it sets ``DMTD_SERVE_INTERNAL_HOST=127.0.0.1`` and
each of our deployments, in its constructor (before Serve starts that server), rewrites the address.
On Kubernetes the variable is unset: replicas must be reachable from the other pods.
"""

from __future__ import annotations

import logging
import os
from typing import Any

HOST_ENV = "DMTD_SERVE_INTERNAL_HOST"
log = logging.getLogger("dmtd.serve.binding")


def bind_serve_internal_grpc(host: str | None = None) -> bool:
    """Bind this process's Serve inter-deployment gRPC server to ``host`` (default: ``$DMTD_SERVE_INTERNAL_HOST``).

    Returns whether the rewrite is in place (False when no host is asked for or Serve's internals changed)."""
    host = host or os.environ.get(HOST_ENV)
    if not host:
        return False
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return False
    original: Any = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None:
        log.warning("%s=%s ignored: this Ray Serve has no add_port_to_grpc_server", HOST_ENV, host)
        return False
    if getattr(original, "_dmtd_host", None) == host:
        return True
    inner = getattr(original, "_dmtd_original", original)

    def add_port(server: Any, address: str) -> int:
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return int(inner(server, address))

    add_port._dmtd_host = host  # type: ignore[attr-defined]
    add_port._dmtd_original = inner  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port
    return True
