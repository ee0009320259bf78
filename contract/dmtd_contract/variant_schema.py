"""The routing conventions and lifecycle of a DMTD variant: one definition each, shared by the engine
(``DMTDConfig``), the variant manifest, the training config and the registry entry (docs/design.md §1)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

# Where cycles start: `prompt_end` (the last prompt position is the first head) or `absolute` (pos % τ == 0).
PhaseAnchor = Literal["prompt_end", "absolute"]
# The decoding layers' input at heads: h_enc + h_think (`residual_add`, the paper) or h_think (`replace`).
HeadInput = Literal["residual_add", "replace"]
# A registry entry's lifecycle: registered, taking traffic, withdrawn.
VariantStatus = Literal["staged", "active", "retired"]

PHASE_ANCHORS: tuple[str, ...] = get_args(PhaseAnchor)
HEAD_INPUTS: tuple[str, ...] = get_args(HeadInput)
STATUSES: tuple[VariantStatus, ...] = get_args(VariantStatus)
# The cycle profile a request gets when it names none: `dmtd` (gated tails emit their tokens; the replica's
# adaptive controller sets τ and the gate) or `exact` (verified cycles: tails are drafts, the output is the
# verifier's).
DefaultProfile = Literal["dmtd", "exact"]
# What verified cycles reproduce: `base` (the base model) or `variant` (the variant's own τ = 1 path).
VerifierName = Literal["base", "variant"]

DEFAULT_PROFILES: tuple[str, ...] = get_args(DefaultProfile)
VERIFIERS: tuple[str, ...] = get_args(VerifierName)
LORA_A_SUFFIX = ".lora_A"


def verifier_of(changed: Iterable[str], decoding_start: int, num_layers: int, head_input: str) -> VerifierName:
    """The verifier of a variant, from the names of the base tensors its files change.

    ``base`` when every changed tensor lies in the decoding group (``layers.{i}.`` with ``i >= decoding_start``:
    the base copies of those layers, with ``replace`` head routing, reproduce the base model) or when nothing
    changes under ``replace`` routing (the variant is the base); else ``variant``, its own τ = 1 path.
    """
    names = set(changed)
    if not names:
        return "base" if head_input == "replace" else "variant"
    prefix = tuple(f"layers.{i}." for i in range(decoding_start, num_layers))
    return "base" if all(n.startswith(prefix) for n in names) else "variant"


def changed_tensors(tensor_names: Iterable[str], adapter: bool) -> set[str]:
    """The base tensors a variant file changes: a weights file its tensors, an adapter the weights its
    ``<name>.lora_A`` factors update."""
    if not adapter:
        return {n for n in tensor_names if n != "__metadata__"}
    return {n[: -len(LORA_A_SUFFIX)] for n in tensor_names if n.endswith(LORA_A_SUFFIX)}
