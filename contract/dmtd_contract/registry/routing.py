"""A consistent, in-memory view of the registry at one revision, and the routing rules over it.

Routing a request (``RegistrySnapshot.resolve``):

* a request that names a variant gets that variant if it is active (``VariantNotFound`` if unknown,
  ``VariantNotActive`` if staged or retired);
* a request that names none is routed by traffic weight among the active variants (``choose``): weights are
  relative, so 0.9 / 0.1 sends 90 % / 10 %; when no active variant has a weight above 0, the default variant
  takes it; with neither, ``VariantNotFound``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dmtd_contract.registry.entry import VariantEntry
from dmtd_contract.registry.errors import VariantNotActive, VariantNotFound
from dmtd_contract.variant_schema import VariantStatus

RandomSource = random.Random | Callable[[], float]


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    """Every entry and the default at one global ``revision``; reads never touch Redis."""

    revision: int
    entries: Mapping[str, VariantEntry] = field(default_factory=dict)
    default_name: str | None = None

    def get(self, name: str) -> VariantEntry:
        """The entry of that name, whatever its status."""
        try:
            return self.entries[name]
        except KeyError:
            raise VariantNotFound(name) from None

    def list(self, status: VariantStatus | None = None) -> list[VariantEntry]:
        """Entries sorted by name, optionally only those in ``status``."""
        return [e for _, e in sorted(self.entries.items()) if status is None or e.status == status]

    def default(self) -> VariantEntry:
        """The default variant (always active: retiring the default clears it)."""
        if self.default_name is None:
            raise VariantNotFound(None, "the registry has no default variant")
        return self.get(self.default_name)

    def traffic_shares(self) -> dict[str, float]:
        """The fraction of unnamed requests each active variant receives (sums to 1, or empty)."""
        weighted = {e.name: e.traffic_weight for e in self.list("active") if e.traffic_weight > 0}
        if weighted:
            total = sum(weighted.values())
            return {name: w / total for name, w in weighted.items()}
        if self.default_name is not None and self.default_name in self.entries:
            return {self.default_name: 1.0}
        return {}

    def choose(self, rng: RandomSource) -> VariantEntry:
        """Pick a variant for an unnamed request by traffic weight; deterministic given ``rng``."""
        shares = self.traffic_shares()
        if not shares:
            raise VariantNotFound(None, "no active variant takes unnamed requests: promote one to default "
                                  "or give an active variant a traffic weight > 0")
        u = rng.random() if isinstance(rng, random.Random) else rng()
        return self.get(pick_weighted(sorted(shares.items()), u))

    def resolve(self, name: str | None, rng: RandomSource) -> VariantEntry:
        """The variant a request goes to: the named one if active, else one chosen by ``choose``."""
        if not name:
            return self.choose(rng)
        entry = self.get(name)
        if entry.status != "active":
            raise VariantNotActive(name, entry.status)
        return entry


def pick_weighted(weights: list[tuple[str, float]], u: float) -> str:
    """The name whose cumulative-weight interval holds ``u * total`` (``u`` in [0, 1))."""
    assert weights, "pick_weighted needs at least one weight"
    x = u * sum(w for _, w in weights)
    acc = 0.0
    for name, w in weights:
        acc += w
        if x < acc:
            return name
    return weights[-1][0]
