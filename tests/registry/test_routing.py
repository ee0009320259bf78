"""Routing over a snapshot: named requests, canary weights, the default (pure, no Redis)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dmtd_contract.registry import RegistrySnapshot, VariantEntry, VariantNotActive, VariantNotFound, pick_weighted
from tests.registry.conftest import spec


def entry(name: str, status: str = "active", weight: float = 0.0) -> VariantEntry:
    return VariantEntry.model_validate({**spec(name).model_dump(), "status": status, "traffic_weight": weight})


def snapshot(*entries: VariantEntry, default: str | None = None) -> RegistrySnapshot:
    return RegistrySnapshot(7, {e.name: e for e in entries}, default)


def test_canary_split_follows_the_weights_and_is_deterministic() -> None:
    snap = snapshot(entry("stable", weight=0.9), entry("canary", weight=0.1), entry("staged", "staged", 1.0),
                    entry("old", "retired", 1.0), default="stable")
    picks = [snap.choose(random.Random(42)).name for _ in range(3)]
    assert len(set(picks)) == 1, "the same random source gives the same choice"
    rng = random.Random(0)
    counts = Counter(snap.resolve(None, rng).name for _ in range(20_000))
    assert set(counts) == {"stable", "canary"}, "staged and retired variants take no unnamed traffic"
    assert counts["canary"] / 20_000 == pytest.approx(0.1, abs=0.01)
    assert snap.traffic_shares() == pytest.approx({"stable": 0.9, "canary": 0.1})


def test_weights_are_relative() -> None:
    snap = snapshot(entry("a", weight=0.2), entry("b", weight=0.2))
    assert snap.traffic_shares() == {"a": 0.5, "b": 0.5}
    assert snap.choose(lambda: 0.49).name == "a" and snap.choose(lambda: 0.5).name == "b"


def test_without_weights_the_default_takes_unnamed_requests() -> None:
    snap = snapshot(entry("a"), entry("b"), default="b")
    assert snap.resolve(None, random.Random(1)).name == "b"
    assert snap.resolve("", random.Random(1)).name == "b"
    assert snap.default().name == "b"
    assert snap.traffic_shares() == {"b": 1.0}


def test_named_requests_need_an_active_variant() -> None:
    snap = snapshot(entry("a", weight=1.0), entry("s", "staged"), entry("r", "retired"))
    assert snap.resolve("a", random.Random(0)).name == "a"
    with pytest.raises(VariantNotActive, match="'s' is staged, not active") as e:
        snap.resolve("s", random.Random(0))
    assert isinstance(e.value, VariantNotFound), "the gateway maps both to NOT_FOUND"
    with pytest.raises(VariantNotActive, match="retired"):
        snap.resolve("r", random.Random(0))
    with pytest.raises(VariantNotFound, match="'ghost' not found"):
        snap.resolve("ghost", random.Random(0))
    assert snap.get("s").status == "staged", "get returns any status"


def test_nothing_routable_is_not_found() -> None:
    snap = snapshot(entry("s", "staged", 1.0))
    with pytest.raises(VariantNotFound, match="no active variant takes unnamed requests"):
        snap.resolve(None, random.Random(0))
    with pytest.raises(VariantNotFound, match="no default"):
        snap.default()
    assert snap.list("active") == [] and [e.name for e in snap.list()] == ["s"]


def test_pick_weighted_intervals() -> None:
    w = [("a", 1.0), ("b", 3.0)]
    assert [pick_weighted(w, u) for u in (0.0, 0.249, 0.25, 0.999)] == ["a", "a", "b", "b"]
    assert pick_weighted(w, 1.0) == "b"
