"""Variant routing for the gateway: names → replica handles, canary weights, the default variant.

The weighted draw is the registry's own (``dmtd_contract.registry.pick_weighted``), and an unknown or
inactive variant is the registry's ``VariantNotFound``: one router, one error, whether the weights come
from the registry or from the app's arguments.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dmtd_contract.registry import RouteInfo, VariantNotFound, pick_weighted


@dataclass(slots=True)
class Route:
    name: str
    handle: Any  # a Serve DeploymentHandle (or any object with the same ``options().generate_batches.remote`` API)
    info: RouteInfo = field(default_factory=RouteInfo)

    @property
    def weight(self) -> float:
        return self.info.traffic_weight

    @property
    def active(self) -> bool:
        return self.info.status == "active"


class Router:
    """Picks the route of a request: the named variant, else a weighted draw among active variants."""

    def __init__(self, routes: dict[str, Route], default: str | None = None, rng: random.Random | None = None):
        self.routes = routes
        self.default = default
        self.rng = rng or random.Random()
        self.revision = 0
        self.primaries = dict(routes)  # the deployments' own variants; the others are their replicas' tails
        self.refused: dict[str, str] = {}  # variants the replicas refused to load → why

    def resolve(self, name: str) -> Route:
        if name:
            route = self.routes.get(name)
            if route is None and name in self.refused:
                raise VariantNotFound(name, f"variant {name!r} is not served: {self.refused[name]}")
            if route is None or not route.active:
                known = ", ".join(sorted(n for n, r in self.routes.items() if r.active)) or "none"
                raise VariantNotFound(name, f"variant {name!r} is not served here (active: {known})")
            return route
        active = [r for r in self.routes.values() if r.active and r.weight > 0]
        if not active:
            if self.default and self.default in self.routes:
                return self.routes[self.default]
            raise VariantNotFound(None, "no active variant to route to")
        return self.routes[pick_weighted([(r.name, r.weight) for r in active], self.rng.random())]

    def update(self, name: str, changes: RouteInfo | Mapping[str, Any], revision: int = 0) -> None:
        """Apply a registry change (a whole ``RouteInfo``, or some of its fields) to a served variant."""
        if name in self.routes:
            route = self.routes[name]
            route.info = changes if isinstance(changes, RouteInfo) else route.info.updated(changes)
        self.revision = max(self.revision, revision)

    def serve_tails(self, primary: str, report: Mapping[str, Any], info_of: Any = None) -> None:
        """The variants ``primary``'s replicas serve beside it (``report``: their ``served_variants()``) become routes
        to its deployment; those they refused, refusals naming why; a tail they no longer serve, no route.
        ``info_of(name)``: its registry view (a ``RouteInfo``), else None: active, no share of unnamed requests."""
        handle = self.primaries[primary].handle
        served = set(report.get("served", {}))
        for name in served:
            if name in self.primaries:
                continue
            info = info_of(name) if info_of is not None else None
            route = self.routes.get(name)
            if route is None or route.handle is not handle:
                self.routes[name] = Route(name, handle, info or RouteInfo(name=name, traffic_weight=0.0))
            elif info is not None:
                route.info = info
            self.refused.pop(name, None)
        for name, route in list(self.routes.items()):
            if name not in self.primaries and route.handle is handle and name not in served:
                del self.routes[name]
        for name, why in dict(report.get("failed", {})).items():
            if name not in served:
                self.refused[name] = why

    def infos(self) -> list[dict[str, Any]]:
        return [{**r.info.public(), "name": n, "is_default": n == self.default} for n, r in sorted(self.routes.items())]
