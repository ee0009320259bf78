"""The operator's Redis registry writer against a real redis-server and the real ``dmtd.registry`` client."""

from __future__ import annotations

import asyncio

import kopf
import pytest
from tests.registry.conftest import redis_server  # noqa: F401 — the session redis-server fixture

from dmtd_contract.registry import RegistryClient, VariantSpec
from dmtd_operator.registry import RedisRegistry, RegistryEntry, VariantEntry


def entry(weights: dict[str, int], tau_min: int = 1, tau_max: int = 3) -> RegistryEntry:
    return RegistryEntry("ns", "dep", tuple(VariantEntry(n, f"s3://m/{n}", w) for n, w in weights.items()), 2,
                         tau_min, tau_max, "dep-gateway.ns.svc:9000", "redis://unused")


def test_publish_activates_weights_and_tau_then_withdraw_zeroes(redis_server):  # noqa: F811
    url = redis_server.rsplit("/", 1)[0] + "/5"
    with RegistryClient(url) as reg:
        for name in ("op-a", "op-b"):
            reg.register(VariantSpec.model_validate({"name": name, "num_thinking_layers": 22,
                                                     "num_decoding_layers": 8, "tau_max": 4}))
    writer = RedisRegistry(url)
    asyncio.run(writer.publish(entry({"op-a": 90, "op-b": 10}, tau_max=3), None))
    with RegistryClient(url) as reg:
        a, b = reg.get("op-a"), reg.get("op-b")
        assert (a.status, b.status) == ("active", "active")
        assert (a.traffic_weight, b.traffic_weight) == (0.9, 0.1)
        assert (a.tau_min, a.tau_max) == (1, 3)
        rev = reg.revision()
    asyncio.run(writer.publish(entry({"op-a": 90, "op-b": 10}, tau_max=3), None))  # idempotent: no new writes
    with RegistryClient(url) as reg:
        assert reg.revision() == rev
    asyncio.run(writer.withdraw("ns", "dep"))
    with RegistryClient(url) as reg:
        assert reg.get("op-a").traffic_weight == 0.0 and reg.get("op-b").traffic_weight == 0.0


def test_unregistered_variant_is_a_temporary_error(redis_server):  # noqa: F811
    url = redis_server.rsplit("/", 1)[0] + "/6"
    with pytest.raises(kopf.TemporaryError, match="dmtd variants register"):
        asyncio.run(RedisRegistry(url).publish(entry({"never-registered": 100}), None))


def test_narrowing_tau_below_the_default_tau_takes_the_default_along(redis_server):  # noqa: F811
    # Found by the operator-image smoke test: the chart's default deployment starts at tau_max 1 while a
    # registered variant defaults to tau 3; the registry refused the update and nothing was mirrored.
    url = redis_server.rsplit("/", 1)[0] + "/7"
    with RegistryClient(url) as reg:
        reg.register(VariantSpec.model_validate({"name": "op-c", "num_thinking_layers": 22,
                                                 "num_decoding_layers": 8, "tau_max": 4, "default_tau": 3}))
    asyncio.run(RedisRegistry(url).publish(entry({"op-c": 100}, tau_min=1, tau_max=1), None))
    with RegistryClient(url) as reg:
        c = reg.get("op-c")
    assert (c.status, c.tau_min, c.tau_max, c.default_tau, c.traffic_weight) == ("active", 1, 1, 1, 1.0)
