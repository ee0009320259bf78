"""The gateway's router: named variants, canary weights drawn with the registry's rule, the default."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dmtd.serve.routing import Route, Router
from dmtd_contract.registry import RouteInfo, VariantNotFound, pick_weighted


def router(**weights: float) -> Router:
    routes = {n: Route(n, object(), RouteInfo(traffic_weight=w, status="active")) for n, w in weights.items()}
    return Router(routes, default="stable", rng=random.Random(7))


def test_unnamed_requests_follow_the_canary_weights() -> None:
    r = router(stable=0.9, canary=0.1)
    counts = Counter(r.resolve("").name for _ in range(5000))
    assert counts.keys() == {"stable", "canary"} and abs(counts["canary"] / 5000 - 0.1) < 0.02


def test_the_draw_is_the_registrys_pick_weighted() -> None:
    r, rng = router(stable=3.0, canary=1.0), random.Random(11)
    r.rng = random.Random(11)
    draws = [r.resolve("").name for _ in range(200)]
    assert draws == [pick_weighted([("stable", 3.0), ("canary", 1.0)], rng.random()) for _ in range(200)]


def test_named_inactive_and_empty_cases() -> None:
    r = router(stable=1.0, canary=0.0)
    assert r.resolve("canary").name == "canary"  # named: weight 0 does not matter
    r.update("canary", {"status": "retired"})
    with pytest.raises(VariantNotFound, match="not served here"):
        r.resolve("canary")
    r.update("stable", {"traffic_weight": 0.0})
    assert r.resolve("").name == "stable"  # no weight anywhere: the default takes it
    r.default = None
    with pytest.raises(VariantNotFound, match="no active variant"):
        r.resolve("")


def test_the_variants_a_deployment_serves_beside_its_own_route_to_it_and_refusals_name_why() -> None:
    r = router(stable=1.0, canary=0.0)
    stable = r.routes["stable"].handle
    r.serve_tails("stable", {"served": {"lite": {}, "canary": {}}, "failed": {"broken": "adapter checksum mismatch"}})
    assert r.resolve("lite").handle is stable and r.resolve("lite").weight == 0.0
    assert r.resolve("canary").handle is r.primaries["canary"].handle  # a deployment's own stays its own
    assert [i["name"] for i in r.infos()] == ["canary", "lite", "stable"]
    with pytest.raises(VariantNotFound, match="'broken' is not served: adapter checksum mismatch"):
        r.resolve("broken")
    assert Counter(r.resolve("").name for _ in range(200)) == {"stable": 200}  # weight 0: by name only
    r.serve_tails("stable", {"served": {}, "failed": {}})  # let go: no route
    with pytest.raises(VariantNotFound, match="'lite' is not served here"):
        r.resolve("lite")
