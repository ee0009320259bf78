"""Registry entries: how the operator tells the serving side what a deployment serves.

The real variant registry is Redis (pub/sub); its client is ``dmtd_contract.registry``, shared with the
serving side. The operator only needs to
publish "deployment X serves variants V with weights W at tau bounds T behind gateway G" and withdraw it
on delete, so it depends on the `RegistryWriter` interface. The default writer mirrors the entry into a
ConfigMap `<name>-registry`; `RedisRegistry` writes the real registry (and keeps the ConfigMap mirror).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import kopf

from dmtd_contract.registry import RegistryClient, RegistryUnavailable, VariantNotFound
from dmtd_operator import resources as r
from dmtd_operator.kube import ConflictError, KubeApi, ObjectRef


@dataclass(frozen=True, slots=True)
class VariantEntry:
    name: str
    model_uri: str
    weight: int


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """What one DMTDDeployment serves, as the registry should see it."""

    namespace: str
    deployment: str
    variants: tuple[VariantEntry, ...]
    replicas: int
    tau_min: int
    tau_max: int
    gateway: str
    registry_url: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


class RegistryWriter(Protocol):
    """Publishes and withdraws registry entries."""

    async def publish(self, entry: RegistryEntry, owner: dict[str, Any] | None) -> None:
        """Make `entry` current (idempotent)."""
        ...

    async def withdraw(self, namespace: str, deployment: str) -> None:
        """Remove the entry of `deployment` (idempotent)."""
        ...


class NullRegistry:
    """Publishes nothing (the serving side is configured by other means)."""

    async def publish(self, entry: RegistryEntry, owner: dict[str, Any] | None) -> None:
        return None

    async def withdraw(self, namespace: str, deployment: str) -> None:
        return None


class ConfigMapRegistry:
    """Mirrors each entry into ConfigMap `<deployment>-registry`, key `entry.json`."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api

    @staticmethod
    def ref(namespace: str, deployment: str) -> ObjectRef:
        return ObjectRef("v1", "configmaps", namespace, r.registry_configmap_name(deployment))

    async def publish(self, entry: RegistryEntry, owner: dict[str, Any] | None) -> None:
        ref = self.ref(entry.namespace, entry.deployment)
        meta: dict[str, Any] = {
            "name": ref.name,
            "namespace": ref.namespace,
            "labels": r.child_labels(entry.deployment, "registry"),
        }
        if owner is not None:
            meta["ownerReferences"] = [owner]
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"entry.json": entry.to_json()},
        }
        live = await self.api.get(ref)
        if live is None:
            try:
                await self.api.create(ref, body)
                return
            except ConflictError:
                live = await self.api.get(ref)
        if live is None or (live.get("data") or {}).get("entry.json") != entry.to_json():
            await self.api.patch(ref, {"metadata": {"labels": meta["labels"]}, "data": body["data"]})

    async def withdraw(self, namespace: str, deployment: str) -> None:
        await self.api.delete(self.ref(namespace, deployment))


class RedisRegistry:
    """Publishes into the Redis variant registry (``dmtd.registry``) the serving side follows.

    A variant's manifest is registered by its owner (``dmtd variants register``); the operator makes the
    variants a deployment serves active, sets their canary weights (percent → share) and τ bounds, and on
    delete takes their traffic weight back to 0 (other deployments may still serve them). Entries are also
    mirrored into the ConfigMap (``mirror``) for ``kubectl`` users.
    """

    def __init__(self, url: str, mirror: RegistryWriter | None = None) -> None:
        self.url = url
        self.mirror = mirror or NullRegistry()
        self.served: dict[tuple[str, str], list[str]] = {}

    async def publish(self, entry: RegistryEntry, owner: dict[str, Any] | None) -> None:
        await asyncio.to_thread(self._publish_sync, entry)
        self.served[(entry.namespace, entry.deployment)] = [v.name for v in entry.variants]
        await self.mirror.publish(entry, owner)

    def _publish_sync(self, entry: RegistryEntry) -> None:
        try:
            with RegistryClient(self.url) as reg:
                for v in entry.variants:
                    try:
                        current = reg.get(v.name)
                    except VariantNotFound as e:
                        raise kopf.TemporaryError(
                            f"variant {v.name!r} is not in the registry at {self.url}: register its manifest "
                            "with `dmtd variants register` first", delay=30) from e
                    if current.status != "active":
                        reg.promote(v.name)
                    share = v.weight / 100.0
                    if abs(current.traffic_weight - share) > 1e-9:
                        reg.set_weight(v.name, share)
                    tau_max = min(entry.tau_max, current.tau_max)
                    tau_min = min(entry.tau_min, tau_max)
                    if (current.tau_min, current.tau_max) != (tau_min, tau_max):
                        # The entry's default τ must stay inside its bounds: narrowing takes it along.
                        default_tau = max(tau_min, min(current.default_tau, tau_max))
                        reg.update(v.name, tau_min=tau_min, tau_max=tau_max, default_tau=default_tau)
        except RegistryUnavailable as e:
            raise kopf.TemporaryError(f"registry {self.url} unavailable: {e}", delay=15) from e

    async def withdraw(self, namespace: str, deployment: str) -> None:
        names = self.served.pop((namespace, deployment), [])
        if names:
            await asyncio.to_thread(self._zero_weights, names)
        await self.mirror.withdraw(namespace, deployment)

    def _zero_weights(self, names: list[str]) -> None:
        with RegistryClient(self.url) as reg:
            for name in names:
                with contextlib.suppress(VariantNotFound):
                    reg.set_weight(name, 0.0)
