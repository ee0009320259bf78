"""The routing conventions and lifecycle of a DMTD variant: one definition each, shared by the engine
(``DMTDConfig``), the variant manifest, the training config and the registry entry (docs/design.md §1)."""

from __future__ import annotations

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
