"""How many drafts a verified cycle should make: the length that maximises expected tokens per unit of cost.

With per-position acceptance ``a_1, a_2, …`` (the chance that draft j is accepted given the ones before
it were), a cycle with ``m`` drafts yields ``1 + a_1 + a_1·a_2 + …`` tokens and costs ``k(m) + m·c`` —
the check over ``m + 1`` positions plus ``m`` tail passes, in units of a one-position check (a plain base
step). Both sides are measured as the engine runs: acceptance per request and per tail position (with a
prior), pass costs per batch size and check width (running means, with a prior from weight bytes). When
no length pays, ``m = 0``: the cycle is a plain base step, so the exact profile is never slower than the
base model alone by more than its measuring. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior acceptance


@dataclass(slots=True)
class PassCosts:
    """Running mean seconds of checks (by batch size and positions per row) and of draft steps (by batch size)."""

    tail_prior: float = 0.45  # a tail pass ÷ a full pass, before any is measured
    check_prior_per_position: float = 0.05  # memory-bound: one more position re-reads no weights
    decay: float = 0.9
    checks: dict[tuple[int, int], float] = field(default_factory=dict)
    drafts: dict[int, float] = field(default_factory=dict)

    def observe_check(self, batch: int, positions: int, seconds: float) -> None:
        self._mean(self.checks, (batch, positions), seconds)

    def observe_draft(self, batch: int, seconds: float) -> None:
        self._mean(self.drafts, batch, seconds)

    def _mean(self, table: dict[Any, float], key: Any, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def cycle_cost(self, batch: int, num_drafts: int) -> float:
        """Cost of a cycle with ``num_drafts`` drafts, in one-position checks at this batch size."""
        unit = self.checks.get((batch, 1))
        if unit is None:
            return 1 + num_drafts * (self.check_prior_per_position + self.tail_prior)
        check = self.checks.get((batch, num_drafts + 1))
        check_cost = check / unit if check is not None else 1 + num_drafts * self.check_prior_per_position
        tail = self.drafts.get(batch)
        tail_cost = tail / unit if tail is not None else self.tail_prior
        return check_cost + num_drafts * tail_cost


def expected_tokens(accepted_by_pos: list[int], drafted_by_pos: list[int], num_drafts: int,
                    prior: float = PRIOR_ACCEPTANCE) -> float:
    """``1 + a_1 + a_1·a_2 + …`` over ``num_drafts`` positions, each ``a_j`` smoothed toward ``prior``."""
    total, run = 1.0, 1.0
    for j in range(num_drafts):
        acc = accepted_by_pos[j] if j < len(accepted_by_pos) else 0
        drafted = drafted_by_pos[j] if j < len(drafted_by_pos) else 0
        # a_j is conditional: draft j counts only in cycles that drafted it after j − 1 accepted drafts
        reached = drafted if j == 0 else min(drafted, accepted_by_pos[j - 1] if j - 1 < len(accepted_by_pos) else 0)
        run *= (acc + prior * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)
        total += run
    return total


def best_num_drafts(max_drafts: int, batch: int, costs: PassCosts, accepted_by_pos: list[int],
                    drafted_by_pos: list[int], prior: float = PRIOR_ACCEPTANCE) -> int:
    """The draft count in ``0..max_drafts`` with the most expected tokens per unit of cost."""
    best, best_rate = 0, 1.0 / costs.cycle_cost(batch, 0)
    for m in range(1, max_drafts + 1):
        rate = expected_tokens(accepted_by_pos, drafted_by_pos, m, prior) / costs.cycle_cost(batch, m)
        if rate > best_rate:
            best, best_rate = m, rate
    return best
