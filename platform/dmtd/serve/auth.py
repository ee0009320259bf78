"""Optional API keys and TLS for the gateway's gRPC and HTTP servers.

Keys come from a file (one a line, ``#`` comments) and/or the environment variable ``DMTD_API_KEYS``
(comma- or newline-separated; on Kubernetes it is filled from a Secret). With no key configured every call
is allowed, as before. With keys, HTTP wants ``Authorization: Bearer KEY`` (or HTTP Basic with the key as
password, which is how a browser opens the dashboard) and gRPC wants ``authorization: Bearer KEY`` metadata;
otherwise HTTP 401 / gRPC ``UNAUTHENTICATED``. ``grpc.health.v1`` and ``/healthz`` stay open for probes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

KEYS_ENV = "DMTD_API_KEYS"
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)


class AuthConfigError(ValueError):
    """The API keys or the TLS files cannot be read."""


class ApiKeys:
    """A set of accepted keys (held as SHA-256 digests, compared in constant time)."""

    def __init__(self, keys: list[str] | tuple[str, ...] = ()) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]

    @classmethod
    def load(cls, path: str | None = None, env: str = KEYS_ENV) -> ApiKeys:
        """Keys from ``path`` (if given) plus the environment variable ``env``."""
        keys: list[str] = []
        if path:
            try:
                text = Path(path).read_text()
            except OSError as e:
                raise AuthConfigError(f"api_keys_file: cannot read {path!r} ({e.strerror})") from e
            keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        keys += [k.strip() for k in os.environ.get(env, "").replace("\n", ",").split(",") if k.strip()]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, key: str | None) -> bool:
        if not self.enabled:
            return True
        if not key:
            return False
        d = hashlib.sha256(key.encode(errors="replace")).digest()
        return any(hmac.compare_digest(d, k) for k in self._digests)  # noqa: SIM110 — every key compared

    def accepts_header(self, authorization: str | None) -> bool:
        """``Bearer KEY`` or ``Basic base64(user:KEY)``."""
        return self.accepts(key_from_header(authorization)) if self.enabled else True


def key_from_header(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, rest = value.strip().partition(" ")
    if scheme.lower() == "bearer":
        return rest.strip() or None
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(rest.strip(), validate=True).decode().partition(":")[2] or None
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but the health checks without an accepted ``authorization`` metadata value."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = str(details.method)
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        md = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        if self.keys.accepts_header(md.get("authorization")):
            return handler
        return _refusal(handler)


def _refusal(handler: Any) -> Any:
    message = "missing or invalid API key (send metadata authorization: Bearer <key>)"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover — makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


def server_credentials(cert_file: str | None, key_file: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC server from a PEM cert/key pair (None: plaintext)."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise AuthConfigError("tls: both tls_cert_file and tls_key_file are required")
    try:
        pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    except OSError as e:
        raise AuthConfigError(f"tls: cannot read {e.filename!r} ({e.strerror})") from e
    return grpc.ssl_server_credentials([pair])
