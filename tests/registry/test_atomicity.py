"""All-or-nothing writes: a registration that fails half-way leaves no entry, no index and no revision."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from dmtd_contract.registry import RegistryClient, RegistryUnavailable, VariantNotFound
from dmtd_contract.registry.client import RegistryClient as ClientClass
from tests.registry.conftest import spec


def registry_keys(registry_url: str) -> list[str]:
    with redis.Redis.from_url(registry_url, decode_responses=True) as r:
        return sorted(str(k) for k in r.keys("*"))


def assert_nothing_written(client: RegistryClient, registry_url: str, name: str) -> None:
    with pytest.raises(VariantNotFound):
        client.get(name)
    assert client.list() == [] and client.list("active") == []
    assert client.revision() == 0 and client.default_name() is None
    assert registry_keys(registry_url) == []


def test_failure_between_entry_and_indexes_leaves_nothing(client: RegistryClient, registry_url: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[str] = []
    queue_entry = ClientClass._queue_entry

    def entry_then_record(self: RegistryClient, pipe: redis.client.Pipeline, entry: object) -> None:
        queue_entry(self, pipe, entry)  # type: ignore[arg-type]
        steps.append("entry queued")

    def crash(*args: object) -> None:
        steps.append("crash before indexes")
        raise RuntimeError("injected failure between the entry and its indexes")

    monkeypatch.setattr(ClientClass, "_queue_entry", entry_then_record)
    monkeypatch.setattr(ClientClass, "_queue_indexes", crash)
    with pytest.raises(RuntimeError, match="injected"):
        client.register(spec("a"), status="active")
    assert steps == ["entry queued", "crash before indexes"]
    assert_nothing_written(client, registry_url, "a")

    monkeypatch.undo()
    entry = client.register(spec("a"), status="active")
    assert (entry.revision, entry.registry_revision) == (1, 1)
    assert client.default_name() == "a" and [e.name for e in client.list("active")] == ["a"]


def test_failure_between_indexes_and_notice_of_a_promotion_changes_nothing(
        client: RegistryClient, monkeypatch: pytest.MonkeyPatch) -> None:
    before = client.register(spec("a"))
    monkeypatch.setattr(ClientClass, "_queue_notice", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        client.promote("a")
    assert client.get("a") == before
    assert client.list("active") == [] and client.list("staged") == [before]
    assert client.revision() == 1 and client.default_name() is None


@pytest.fixture
def refusing_writes(registry_url: str) -> Iterator[None]:
    """The server refuses every write (maxmemory reached, noeviction) until the test ends."""
    with redis.Redis.from_url(registry_url) as r:
        old = r.config_get("maxmemory")["maxmemory"]
        r.config_set("maxmemory", 1)
        try:
            yield
        finally:
            r.config_set("maxmemory", old)


def test_server_refusing_the_transaction_leaves_nothing(client: RegistryClient, registry_url: str,
                                                        refusing_writes: None) -> None:
    with pytest.raises(RegistryUnavailable, match="refused"):
        client.register(spec("a"), status="active")
    assert_nothing_written(client, registry_url, "a")


def test_connection_lost_mid_transaction_is_retried_whole(client: RegistryClient, registry_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    queue_indexes = ClientClass._queue_indexes
    killed: list[int] = []

    def kill_my_connection_once(self: RegistryClient, pipe: redis.client.Pipeline, *args: object) -> None:
        if not killed:
            with redis.Redis.from_url(registry_url) as admin:
                killed.append(admin.client_kill_filter(_type="normal", skipme=True))
        queue_indexes(self, pipe, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ClientClass, "_queue_indexes", kill_my_connection_once)
    entry = client.register(spec("a"), status="active")
    assert killed and killed[0] >= 1
    assert (entry.revision, entry.registry_revision) == (1, 1), "applied exactly once"
    assert client.get("a") == entry and client.revision() == 1
    assert client.default_name() == "a" and [e.name for e in client.list("active")] == ["a"]
