"""Where the registry keeps things in Redis.

All keys share the hash tag ``{<namespace>}`` so that, on Redis Cluster, a registry lives in one slot and its
transactions may touch several keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmtd_contract.variant_schema import STATUSES, VariantStatus


@dataclass(frozen=True, slots=True)
class RegistryKeys:
    """The key layout of one registry namespace."""

    namespace: str = "dmtd"

    @property
    def prefix(self) -> str:
        return "{" + self.namespace + "}"

    @property
    def revision(self) -> str:
        """Global revision counter: INCR'd by every change."""
        return f"{self.prefix}:revision"

    @property
    def names(self) -> str:
        """Set of every registered name."""
        return f"{self.prefix}:variants"

    @property
    def default(self) -> str:
        """Name of the default variant (string; absent = none)."""
        return f"{self.prefix}:default"

    @property
    def channel(self) -> str:
        """Pub/sub channel of change notices ``{"name", "revision", "change"}``."""
        return f"{self.prefix}:changes"

    def entry(self, name: str) -> str:
        """One entry, as the JSON of a ``VariantEntry``."""
        return f"{self.prefix}:variant:{name}"

    def loads(self, name: str) -> str:
        """Hash of the replicas' loads of one variant: replica → "" (served) or why its files were refused."""
        return f"{self.prefix}:loads:{name}"

    def status(self, status: VariantStatus) -> str:
        """Set of the names in one status."""
        return f"{self.prefix}:status:{status}"

    def status_sets(self) -> list[str]:
        return [self.status(s) for s in STATUSES]
