"""A small async Kubernetes API client for the objects the operator owns.

kopf handles the DMTDDeployment itself; the children (RayService, Services, ConfigMap) go through this
client. It authenticates with the same `kopf.ConnectionInfo` that the operator's login handler returns,
so there is one source of credentials. Writes are JSON merge patches; errors are typed by status code.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import kopf

Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """Where an object lives in the API."""

    api_version: str
    plural: str
    namespace: str
    name: str

    def collection_path(self) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{root}/namespaces/{self.namespace}/{self.plural}"

    def path(self) -> str:
        return f"{self.collection_path()}/{self.name}"


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotFoundError(ApiError):
    """404: the object (or its kind) does not exist."""


class ConflictError(ApiError):
    """409: already exists, or a concurrent write won."""


class KubeApi(Protocol):
    """The four verbs the operator needs on its children."""

    async def get(self, ref: ObjectRef) -> Body | None:
        """The object, or None when it does not exist."""
        ...

    async def create(self, ref: ObjectRef, body: Body) -> Body:
        """Create; raises ConflictError when it already exists."""
        ...

    async def patch(self, ref: ObjectRef, body: Body) -> Body:
        """JSON merge patch; raises NotFoundError when absent."""
        ...

    async def delete(self, ref: ObjectRef) -> bool:
        """Delete; False when it was already gone."""
        ...


class HttpKubeApi:
    """KubeApi over HTTP(S) with aiohttp; `credentials` returns the current `kopf.ConnectionInfo`."""

    def __init__(
        self, credentials: Callable[[], kopf.ConnectionInfo | None], timeout_s: float = 30.0
    ) -> None:
        self._credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._session_for: kopf.ConnectionInfo | None = None

    async def _client(self) -> tuple[aiohttp.ClientSession, str]:
        """A session for the current credentials; a new one when the login handler refreshed them."""
        info = self._credentials()
        if info is None:
            raise kopf.TemporaryError("no Kubernetes credentials yet", delay=5)
        if self._session is None or self._session.closed or self._session_for is not info:
            if self._session is not None:
                await self._session.close()
            ssl_ctx: ssl.SSLContext | bool = (
                info.as_ssl_context() if info.server.startswith("https") else False
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_ctx),
                headers=info.as_http_headers(),
                timeout=self._timeout,
            )
            self._session_for = info
        return self._session, info.server.rstrip("/")

    async def _request(self, method: str, path: str, body: Body | None = None) -> Body | None:
        session, server = await self._client()
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with session.request(method, server + path, json=body, headers=headers) as resp:
            data: Any = await resp.json(content_type=None) if resp.content_length != 0 else None
            if resp.status < 300:
                return data if isinstance(data, dict) else {}
            message = data.get("message", "") if isinstance(data, dict) else str(data)
            reason = data.get("reason", resp.reason or "") if isinstance(data, dict) else (resp.reason or "")
            if resp.status == 404:
                raise NotFoundError(resp.status, reason, message)
            if resp.status == 409:
                raise ConflictError(resp.status, reason, message)
            raise ApiError(resp.status, reason, message)

    async def get(self, ref: ObjectRef) -> Body | None:
        try:
            return await self._request("GET", ref.path())
        except NotFoundError:
            return None

    async def create(self, ref: ObjectRef, body: Body) -> Body:
        return await self._request("POST", ref.collection_path(), body) or {}

    async def patch(self, ref: ObjectRef, body: Body) -> Body:
        return await self._request("PATCH", ref.path(), body) or {}

    async def delete(self, ref: ObjectRef) -> bool:
        try:
            await self._request("DELETE", ref.path())
        except NotFoundError:
            return False
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
