"""Registry entries: how the operator tells the serving side what a deployment serves.

The real variant registry is Redis (pub/sub), owned by the serving side. The operator only needs to
publish "deployment X serves variants V with weights W at tau bounds T behind gateway G" and withdraw it
on delete, so it depends on the `RegistryWriter` interface. The default writer mirrors the entry into a
ConfigMap `<name>-registry` (no Redis client in the operator); a Redis-backed writer can replace it
without touching the reconciler.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

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
