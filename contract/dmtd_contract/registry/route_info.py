"""What the gateway knows of a served variant: the app's arguments at start, then its registry entry's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dmtd_contract.registry.entry import VariantEntry
from dmtd_contract.variant_schema import DefaultProfile, HeadInput, PhaseAnchor, VariantStatus, VerifierName


class RouteInfo(BaseModel):
    """A route's registry view. Before the registry answers only ``name``, ``base_model``, ``status`` and
    ``traffic_weight`` are known; the rest stay None (and out of ``public()``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    base_model: str | None = None
    status: VariantStatus = "active"
    traffic_weight: float = Field(default=1.0, ge=0)
    revision: int | None = None
    tau_min: int | None = None
    tau_max: int | None = None
    default_tau: int | None = None
    min_confidence: float | None = None
    num_encoding_layers: int | None = None
    num_thinking_layers: int | None = None
    num_decoding_layers: int | None = None
    phase_anchor: PhaseAnchor | None = None
    head_input: HeadInput | None = None
    default_profile: DefaultProfile | None = None
    verifier: VerifierName | Literal[""] | None = None  # "": the registry does not know it

    @classmethod
    def from_entry(cls, e: VariantEntry) -> RouteInfo:
        """The served fields of a registry entry."""
        return cls(name=e.name, base_model=e.base_model, status=e.status, traffic_weight=e.traffic_weight,
                   revision=e.revision, tau_min=e.tau_min, tau_max=e.tau_max, default_tau=e.default_tau,
                   min_confidence=e.min_confidence, num_encoding_layers=e.num_encoding_layers,
                   num_thinking_layers=e.num_thinking_layers, num_decoding_layers=e.num_decoding_layers,
                   phase_anchor=e.phase_anchor, head_input=e.head_input, default_profile=e.default_profile,
                   verifier=e.verifier or "")

    def updated(self, changes: Mapping[str, Any]) -> RouteInfo:
        """This info with ``changes`` applied, validated."""
        return RouteInfo.model_validate({**self.model_dump(exclude_unset=True), **changes})

    def public(self) -> dict[str, Any]:
        """The known fields as a plain dict (the gateway's ``info``, ``/v1/models``, ``ListVariants``)."""
        return self.model_dump(exclude_none=True)
