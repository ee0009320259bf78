"""Head masks for cyclical-masking training, exactly as the engine routes a prompt and its continuation."""

from __future__ import annotations

from dmtd.engine.config import DMTDConfig


def head_flags(dmtd: DMTDConfig, prompt_len: int, length: int, tau: int, first_cycle: int | None = None) -> list[bool]:
    """Whether each position ``0..length-1`` of prompt + continuation is a head at cycle length ``tau``.

    ``prompt_end``: every prompt position runs full depth, the last prompt position is the first head, the
    next head follows ``first_cycle`` positions later (default ``tau``; the engine's phase-aligned batches
    shorten it to 1..τ to meet their shared clock), then every ``tau``. ``absolute``: head iff
    ``pos % tau == 0``, prompt included.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1")
    if dmtd.phase_anchor == "absolute":
        return [p % tau == 0 for p in range(length)]
    last = prompt_len - 1
    second = last + (first_cycle or tau)
    return [p <= last or p == second or (p > second and (p - second) % tau == 0) for p in range(length)]
