"""Change notices for the gateway and replicas (asyncio): ``RegistryWatcher`` and ``RegistryView``.

Every registry write PUBLISHes ``{"name", "revision", "change"}`` on the namespace's channel. Pub/sub drops
messages while a subscriber is disconnected, so after every (re)subscription the watcher compares the global
revision with the last it saw and, if it moved, reports a ``resync`` change (``name`` None): whoever keeps
state then reloads it all. ``RegistryView`` does exactly that: it holds a fresh ``RegistrySnapshot``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from dmtd_contract.registry.client import RegistryClient
from dmtd_contract.registry.errors import RegistryUnavailable
from dmtd_contract.registry.keys import RegistryKeys
from dmtd_contract.registry.routing import RegistrySnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RegistryChange:
    """One change: the variant's ``name`` (None for ``resync``), the global ``revision`` it produced and its
    kind: ``registered``, ``promoted``, ``retired``, ``weight``, ``updated``, ``default`` or ``resync``."""

    name: str | None
    revision: int
    change: str


ChangeCallback = Callable[[RegistryChange], Awaitable[None] | None]


class RegistryWatcher:
    """Calls ``on_change`` (plain or async) for every registry change, in revision order, from one task.

    ``await start()`` returns once subscribed: any change committed after it returns is reported. A failing
    callback is logged and does not stop the watcher; a lost connection is retried every ``reconnect_s``.
    """

    def __init__(self, url: str, on_change: ChangeCallback, *, namespace: str = "dmtd",
                 reconnect_s: float = 0.5) -> None:
        self.url = url
        self.keys = RegistryKeys(namespace)
        self._on_change = on_change
        self._reconnect_s = reconnect_s
        self._task: asyncio.Task[None] | None = None
        self.revision = 0
        self.connected = False

    async def start(self) -> None:
        """Subscribe and start the watching task; returns once subscribed (or raises what the first try met)."""
        if self._task is not None:
            return
        try:
            redis_conn, pubsub = await self._subscribe()
            try:
                self.revision = await self._current_revision(redis_conn)
            except BaseException:
                await _close(redis_conn, pubsub)
                raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RegistryUnavailable(f"registry at {self.url} unavailable: {e}") from e
        self._task = asyncio.create_task(self._run(redis_conn, pubsub), name="dmtd-registry-watcher")

    async def stop(self) -> None:
        """Cancel the task and close the connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> RegistryWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _subscribe(self) -> tuple[aioredis.Redis, Any]:
        conn: aioredis.Redis = aioredis.Redis.from_url(self.url, decode_responses=True)
        pubsub: Any = conn.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.keys.channel)
        except BaseException:
            await pubsub.aclose()
            await conn.aclose()
            raise
        self.connected = True
        return conn, pubsub

    async def _current_revision(self, conn: aioredis.Redis) -> int:
        return int(await conn.get(self.keys.revision) or 0)

    async def _run(self, conn: aioredis.Redis, pubsub: Any) -> None:
        try:
            while True:
                try:
                    await self._listen(pubsub)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                    log.warning("registry watcher lost %s (%s); reconnecting", self.url, e)
                self.connected = False
                await _close(conn, pubsub)
                conn, pubsub = await self._reconnect()
        finally:
            self.connected = False
            await _close(conn, pubsub)

    async def _reconnect(self) -> tuple[aioredis.Redis, Any]:
        while True:
            await asyncio.sleep(self._reconnect_s)
            try:
                conn, pubsub = await self._subscribe()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                continue
            try:
                revision = await self._current_revision(conn)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                await _close(conn, pubsub)
                continue
            if revision != self.revision:
                await self._deliver(RegistryChange(None, revision, "resync"))
            return conn, pubsub

    async def _listen(self, pubsub: Any) -> None:
        async for message in pubsub.listen():
            if message.get("type") != "message":
                continue
            try:
                data = json.loads(message["data"])
                change = RegistryChange(data.get("name"), int(data["revision"]), str(data["change"]))
            except (ValueError, KeyError, TypeError):
                log.warning("registry watcher: ignoring malformed notice %r", message.get("data"))
                continue
            if change.revision > self.revision:
                await self._deliver(change)

    async def _deliver(self, change: RegistryChange) -> None:
        self.revision = max(self.revision, change.revision)
        try:
            result = self._on_change(change)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("registry watcher: on_change failed for %s", change)


SnapshotListener = Callable[[RegistrySnapshot, RegistryChange], Awaitable[None] | None]


class RegistryView:
    """A ``RegistrySnapshot`` kept current by a ``RegistryWatcher``: what the gateway routes with and what a
    replica reads its variant's ``min_confidence`` / τ range from, without a Redis call per request.

    ``await view.start()`` loads the snapshot and subscribes; listeners run after each reload with the new
    snapshot and the change that caused it.
    """

    def __init__(self, client: RegistryClient, *, reconnect_s: float = 0.5) -> None:
        self.client = client
        self._listeners: list[SnapshotListener] = []
        self._watcher = RegistryWatcher(client.url, self._on_change, namespace=client.keys.namespace,
                                        reconnect_s=reconnect_s)
        self._snapshot = RegistrySnapshot(0)

    @property
    def snapshot(self) -> RegistrySnapshot:
        """The latest snapshot (replace, never mutate: hold on to one for a consistent read)."""
        return self._snapshot

    def add_listener(self, listener: SnapshotListener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        """Subscribe first, then load, so no change between the two is missed."""
        await self._watcher.start()
        await self.refresh()

    async def stop(self) -> None:
        await self._watcher.stop()

    async def __aenter__(self) -> RegistryView:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def refresh(self, change: RegistryChange | None = None) -> RegistrySnapshot:
        """Reload the snapshot now (in a worker thread) and notify the listeners if it moved."""
        snap = await asyncio.to_thread(self.client.snapshot)
        if snap.revision > self._snapshot.revision or change is None:
            self._snapshot = snap
            why = change or RegistryChange(None, snap.revision, "resync")
            for listener in list(self._listeners):
                try:
                    result = listener(snap, why)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("registry view: listener failed for %s", why)
        return self._snapshot

    async def _on_change(self, change: RegistryChange) -> None:
        if change.revision > self._snapshot.revision:
            await self.refresh(change)


async def _close(conn: aioredis.Redis, pubsub: Any) -> None:
    with contextlib.suppress(Exception):
        await pubsub.aclose()
    with contextlib.suppress(Exception):
        await conn.aclose()
