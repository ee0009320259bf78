"""The engine's model passes timed and counted by kind (prefill, decode, draft, verify, catch_up): benchmarks and the
replica's stats read them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dmtd.engine.sequence import Sequence


class PassTimer:
    """Runs a model pass and counts it: ``stats[kind] = [calls, seconds]``."""

    def __init__(self) -> None:
        self.stats: dict[str, list[float]] = {}

    def __call__(self, kind: str, run: Callable[[list[Sequence]], torch.Tensor],
                 seqs: list[Sequence]) -> tuple[torch.Tensor, float]:
        """Run ``run(seqs)``; returns its output and its seconds."""
        t = time.perf_counter()
        out = run(seqs)
        dt = time.perf_counter() - t
        st = self.stats.setdefault(kind, [0, 0.0])
        st[0] += 1
        st[1] += dt
        return out, dt
