"""Change notices: a watcher and a view see registry changes within 2 s, and recover from a lost connection."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from dmtd_contract.registry import RegistryChange, RegistryClient, RegistrySnapshot, RegistryView, RegistryWatcher
from dmtd_contract.registry.errors import RegistryUnavailable
from tests.registry.conftest import spec

pytestmark = pytest.mark.asyncio


async def test_watcher_sees_each_change_within_2s(client: RegistryClient, registry_url: str) -> None:
    seen: asyncio.Queue[RegistryChange] = asyncio.Queue()
    async with RegistryWatcher(registry_url, seen.put_nowait) as watcher:
        t0 = time.monotonic()
        await asyncio.to_thread(client.register, spec("a"))
        assert await asyncio.wait_for(seen.get(), 2.0) == RegistryChange("a", 1, "registered")
        await asyncio.to_thread(client.promote, "a")
        assert await asyncio.wait_for(seen.get(), 2.0) == RegistryChange("a", 2, "promoted")
        assert time.monotonic() - t0 < 2.0
        assert watcher.revision == 2


async def test_view_applies_a_changed_min_confidence_and_tau_range_within_2s(client: RegistryClient) -> None:
    client.register(spec("a"), status="active")
    applied: asyncio.Queue[tuple[float, int, int]] = asyncio.Queue()

    async def replica_listener(snap: RegistrySnapshot, change: RegistryChange) -> None:
        e = snap.get("a")
        await applied.put((e.min_confidence, e.tau_min, e.tau_max))

    async with RegistryView(client) as view:
        assert view.snapshot.get("a").min_confidence == 0.0 and view.snapshot.revision == 1
        view.add_listener(replica_listener)
        t0 = time.monotonic()
        await asyncio.to_thread(client.update, "a", min_confidence=0.45, tau_min=2, tau_max=6)
        assert await asyncio.wait_for(applied.get(), 2.0) == (0.45, 2, 6)
        assert time.monotonic() - t0 < 2.0
        assert view.snapshot.revision == 2 and view.snapshot.get("a").tau_max == 6


async def test_a_failing_callback_does_not_stop_the_watcher(client: RegistryClient, registry_url: str) -> None:
    seen: list[RegistryChange] = []

    def flaky(change: RegistryChange) -> None:
        seen.append(change)
        if len(seen) == 1:
            raise RuntimeError("listener bug")

    async with RegistryWatcher(registry_url, flaky):
        await asyncio.to_thread(client.register, spec("a"))
        await asyncio.to_thread(client.register, spec("b"))
        for _ in range(200):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
    assert [c.name for c in seen] == ["a", "b"]


async def test_changes_missed_while_disconnected_are_reported_as_resync(client: RegistryClient,
                                                                        registry_url: str) -> None:
    seen: asyncio.Queue[RegistryChange] = asyncio.Queue()
    async with RegistryWatcher(registry_url, seen.put_nowait, reconnect_s=0.3) as watcher:
        with redis.Redis.from_url(registry_url) as admin:
            assert admin.client_kill_filter(_type="pubsub") == 1
        for _ in range(200):
            if not watcher.connected:
                break
            await asyncio.sleep(0.01)
        assert not watcher.connected
        await asyncio.to_thread(client.register, spec("a"))  # published while nobody listens
        assert await asyncio.wait_for(seen.get(), 3.0) == RegistryChange(None, 1, "resync")
        assert watcher.connected
        await asyncio.to_thread(client.promote, "a")
        assert await asyncio.wait_for(seen.get(), 2.0) == RegistryChange("a", 2, "promoted")


async def test_watcher_on_a_dead_registry_raises_unavailable() -> None:
    with pytest.raises(RegistryUnavailable, match="unavailable"):
        await RegistryWatcher("redis://127.0.0.1:1/0", lambda c: None).start()
