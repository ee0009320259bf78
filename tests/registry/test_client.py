"""The registry client against a real redis-server: lifecycle, defaults, revisions, errors."""

from __future__ import annotations

import json

import pytest
import redis

from dmtd_contract.registry import (
    InvalidTransition,
    InvalidVariant,
    RegistryClient,
    RegistryCorrupt,
    RegistryUnavailable,
    VariantExists,
    VariantNotFound,
)
from tests.registry.conftest import spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_register_then_get_and_list(client: RegistryClient) -> None:
    entry = client.register(spec("a"), traffic_weight=0.25)
    assert (entry.status, entry.traffic_weight, entry.revision, entry.registry_revision) == ("staged", 0.25, 1, 1)
    assert client.get("a") == entry
    assert [e.name for e in client.list()] == ["a"]
    assert client.list("staged") == [entry]
    assert client.list("active") == []
    assert client.revision() == 1
    assert client.default_name() is None


def test_register_twice_is_refused_whatever_the_status(client: RegistryClient) -> None:
    client.register(spec("a"))
    client.retire("a")
    with pytest.raises(VariantExists, match="'a' already exists"):
        client.register(spec("a", tau_max=8))
    assert client.get("a").tau_max == 4
    assert client.revision() == 2


def test_lifecycle_moves_indexes_and_the_default(registry_url: str) -> None:
    clock = Clock()
    with RegistryClient(registry_url, clock=clock) as client:
        client.register(spec("a"))
        client.register(spec("b"))
        a = client.promote("a")
        assert (a.status, a.revision, a.created_at_s, a.updated_at_s) == ("active", 2, 1001.0, 1003.0)
        assert client.default_name() == "a", "the first active variant becomes the default"
        client.promote("b")
        assert client.default_name() == "a"
        client.promote("b", make_default=True)
        assert client.default_name() == "b"
        assert [e.name for e in client.list("active")] == ["a", "b"]
        client.retire("b")
        assert client.default_name() is None, "retiring the default clears it"
        assert [e.name for e in client.list("retired")] == ["b"]
        assert [e.name for e in client.list("active")] == ["a"]
        client.promote("b")
        assert client.default_name() == "b" and client.get("b").status == "active"


def test_noop_writes_change_nothing(client: RegistryClient) -> None:
    client.register(spec("a"), status="active")
    rev = client.revision()
    assert client.promote("a").revision == 1
    assert client.set_weight("a", 0.0).revision == 1
    client.retire("a")
    assert client.retire("a").revision == 2
    assert client.revision() == rev + 1


def test_update_revalidates_the_whole_entry(client: RegistryClient) -> None:
    client.register(spec("a"))
    got = client.update("a", min_confidence=0.4, tau_min=2, tau_max=6)
    assert (got.min_confidence, got.tau_min, got.tau_max, got.default_tau, got.revision) == (0.4, 2, 6, 3, 2)
    with pytest.raises(InvalidVariant) as e:
        client.update("a", tau_max=2)
    assert e.value.field == "default_tau" and "[2, 2]" in e.value.rule
    with pytest.raises(InvalidVariant) as e:
        client.update("a", num_decoding_layers=4)
    assert e.value.field == "num_decoding_layers" and "cannot be changed" in e.value.rule
    with pytest.raises(InvalidVariant, match="traffic_weight"):
        client.set_weight("a", -0.1)
    assert client.get("a") == got


def test_unknown_names_and_bad_transitions(client: RegistryClient) -> None:
    for op in (client.get, client.promote, client.retire, client.set_default):
        with pytest.raises(VariantNotFound, match="'ghost' not found"):
            op("ghost")
    with pytest.raises(VariantNotFound):
        client.set_weight("ghost", 0.5)
    with pytest.raises(VariantNotFound, match="no default variant"):
        client.default()
    client.register(spec("a"))
    with pytest.raises(InvalidTransition, match="only an active variant can be the default"):
        client.set_default("a")
    with pytest.raises(InvalidTransition):
        client.register(spec("b"), make_default=True)
    with pytest.raises(InvalidVariant, match="status"):
        client.register(spec("c"), status="retired")
    assert [e.name for e in client.list()] == ["a"]


def test_every_change_is_published_with_its_revision(client: RegistryClient, registry_url: str) -> None:
    with redis.Redis.from_url(registry_url, decode_responses=True) as r, r.pubsub() as sub:
        sub.subscribe(client.keys.channel)
        assert sub.get_message(timeout=1)["type"] == "subscribe"
        client.register(spec("a"))
        client.promote("a")
        client.set_weight("a", 0.5)
        client.update("a", min_confidence=0.2)
        client.retire("a")
        got = [json.loads(sub.get_message(timeout=1)["data"]) for _ in range(5)]
    assert got == [{"name": "a", "revision": i + 1, "change": c}
                   for i, c in enumerate(["registered", "promoted", "weight", "updated", "retired"])]
    assert client.get("a").registry_revision == 5


def test_snapshot_is_consistent_and_routes(client: RegistryClient) -> None:
    client.register(spec("a"), status="active", traffic_weight=0.9)
    client.register(spec("b"), status="active", traffic_weight=0.1)
    client.register(spec("c"))
    snap = client.snapshot()
    assert (snap.revision, snap.default_name) == (3, "a")
    assert [e.name for e in snap.list()] == ["a", "b", "c"]
    assert snap.traffic_shares() == pytest.approx({"a": 0.9, "b": 0.1})
    assert snap.resolve(None, lambda: 0.95).name == "b"


def test_unreachable_registry_raises_unavailable() -> None:
    with RegistryClient("redis://127.0.0.1:1/0", socket_timeout_s=0.5) as client:
        with pytest.raises(RegistryUnavailable, match="unavailable"):
            client.get("a")
        with pytest.raises(RegistryUnavailable):
            client.register(spec("a"))
    with pytest.raises(RegistryUnavailable, match="bad registry URL"):
        RegistryClient("http://example")


def test_foreign_keys_are_reported_not_overwritten(client: RegistryClient, registry_url: str) -> None:
    with redis.Redis.from_url(registry_url) as r:
        r.set(client.keys.status("staged"), "not a set")
        r.set(client.keys.entry("bad"), "{")
    with pytest.raises(RegistryCorrupt, match="is a string, expected none or set"):
        client.register(spec("a"))
    with pytest.raises(RegistryCorrupt, match="not a valid entry"):
        client.get("bad")
    assert client.revision() == 0
