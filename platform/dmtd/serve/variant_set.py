"""The variants a replica serves beside its engine's own, over the same trunk (torch-free bookkeeping): which are
loaded, with what operating point, how many requests each has in flight and when it was last used; which failed to
load and why; which are retiring (they go when their last request ends); and which idle ones go, least recently used
first, to make room under ``max_variants``. The replica does the loading (``DMTDReplica.load_variant``, on the engine's
thread) and asks this set what to do."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dmtd.serve.errors import VariantUnavailable


@dataclass(slots=True)
class ServedVariant:
    """A loaded variant and its operating point (its manifest's: the replica's controller governs its own only)."""

    name: str
    source: str  # the manifest path or shipped name it was loaded from
    nbytes: int  # what its decoding group holds in the engine
    load_s: float
    default_tau: int
    tau_max: int
    min_confidence: float
    default_profile: str
    last_used_s: float = 0.0
    inflight: int = 0
    retiring: bool = False

    def profile_of(self, requested: str) -> str:
        """The profile a request runs with: its own, else the variant's default."""
        return requested or ("exact" if self.default_profile == "exact" else "adaptive")


@dataclass(slots=True)
class VariantSet:
    """The replica's own variant (``own``: requests that name it, or none, run the engine's own tails) and the
    others it serves, at most ``max_variants`` in all."""

    own: str
    max_variants: int = 8
    clock: Callable[[], float] = time.monotonic
    served: dict[str, ServedVariant] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name → why its load was refused
    loading: set[str] = field(default_factory=set)

    def resolve(self, name: str) -> ServedVariant | None:
        """The served variant a request names (None: the replica's own); :class:`VariantUnavailable` naming it and
        why otherwise."""
        if not name or name == self.own:
            return None
        got = self.served.get(name)
        if got is not None and not got.retiring:
            return got
        if got is not None:
            why = "it is retiring"
        elif name in self.loading:
            why = "it is still loading"
        elif name in self.failed:
            why = f"its files were refused: {self.failed[name]}"
        else:
            why = f"it is not loaded here (served: {', '.join(self.names()) or self.own})"
        raise VariantUnavailable(name, f"variant {name!r} is not served by this replica: {why}")

    def names(self) -> list[str]:
        """Every variant served now, the replica's own first."""
        return [self.own, *sorted(n for n, v in self.served.items() if not v.retiring)]

    def begin(self, v: ServedVariant) -> None:
        v.inflight += 1
        v.last_used_s = self.clock()

    def end(self, v: ServedVariant) -> bool:
        """A request of ``v`` ended; True if ``v`` is retiring and now idle (the replica lets it go)."""
        v.inflight -= 1
        v.last_used_s = self.clock()
        return v.retiring and v.inflight == 0

    def to_evict(self) -> list[str] | None:
        """The idle variants to let go, least recently used first, so that one more fits under ``max_variants``
        (its own counts); None if not enough of them are idle."""
        over = len(self.served) + 1 + 1 - self.max_variants
        if over <= 0:
            return []
        idle = sorted((v for v in self.served.values() if v.inflight == 0), key=lambda v: v.last_used_s)
        return [v.name for v in idle[:over]] if len(idle) >= over else None

    def report(self) -> dict[str, object]:
        """What the replica's ``variants()`` answers: served variants with their figures, refusals, loads under way."""
        return {"own": self.own, "max_variants": self.max_variants,
                "served": {n: {"nbytes": v.nbytes, "load_s": round(v.load_s, 3), "inflight": v.inflight,
                               "retiring": v.retiring, "default_profile": v.default_profile, "source": v.source}
                           for n, v in sorted(self.served.items())},
                "failed": dict(self.failed), "loading": sorted(self.loading)}
