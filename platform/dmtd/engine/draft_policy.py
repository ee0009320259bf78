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
# Passes of a kind (batch size, check width) that are not counted: the first runs of a shape pay one-off costs
# (TorchScript's profiling runs, lazily packed draft weights) of several plain steps, and one such outlier in a
# running mean kept a request from ever drafting again (nothing drafted, nothing re-measured).
WARMUP_PASSES = 2
# Draft passes counted in the draft cost: those whose rows catch up on at most this many positions (the head's
# and the new one while a request drafts every cycle). A request that resumes drafting after plain steps first
# feeds its tail path every position since (measured: ~2x a steady draft after 7 plain steps); counting those
# passes, the policy's every-8th-cycle exploration read drafting as twice as costly as it is and never resumed.
STEADY_CATCH_UP = 2
# A draft pass's costs besides its weight reads (picking the token, the step's bookkeeping), in plain steps: the
# prior for a tail is the engine's weight-byte share plus this (measured on the shipped variant, bf16, int8
# drafts: bytes 0.15, a whole draft step 0.17-0.19)
TAIL_PASS_OVERHEAD = 0.05
# Draft passes of at least this many sequences run on the engine's own weights instead of the drafts' i8dot copy, by
# kernel path (dmtd.engine.ops.kernel_path; absent: always the copy). i8dot halves the bytes a row reads, which is what
# a pass of one or two rows waits for; a pass of many rows waits for arithmetic, and where bf16 has its dot-product
# instruction the engine's kernel is the faster one: products of 16 rows, one layer's, bf16 0.17 ms against i8dot
# 0.50 ms, the 8k-column draft head 0.19 against 1.2 (Zen 4, 2 threads); a batch-16 draft pass on i8dot cost 0.75-0.83
# of a plain step. On the avx512 path (bf16 widened to float32) the two were even at 8-16 rows.
DENSE_DRAFT_ROWS = {"avx512bf16": 4}


@dataclass(slots=True)
class PassCosts:
    """Running mean seconds of checks (by batch size and positions per row) and of draft steps (by batch size),
    and the mean number of rows a draft step drafts."""

    tail_prior: float = 0.45  # a tail pass ÷ a full pass, before any is measured
    check_prior_per_position: float = 0.05  # memory-bound: one more position re-reads no weights
    decay: float = 0.9
    checks: dict[tuple[int, int], float] = field(default_factory=dict)
    drafts: dict[int, float] = field(default_factory=dict)
    draft_rows: float | None = None  # running mean of the rows a draft pass drafts (None: as many as the batch)
    seen: dict[Any, int] = field(default_factory=dict)  # passes of each kind so far, the uncounted ones too
    # the one-position check time (of the batch size then) when an entry was last updated: an entry measured
    # rarely (a longer check, a draft, while little is drafted) is scaled by how the machine's speed has moved
    # since, so a slow spell then or now does not read as a costly draft for good (measured: adaptive drafting
    # that paid 1.3x on one run of a prompt stopped on the next, the same engine, after such a spell)
    units_at: dict[Any, tuple[tuple[int, int], float]] = field(default_factory=dict)
    # batch size → running mean cost of one more checked position on one row, in units of a row's share of the
    # one-position check (unit / batch): the step's measured marginal cost of the extra rows. A batched step that is
    # compute-bound makes them dear (bf16 at batch 16 on the Zen 4: ~0.24 of a row's share each, where at batch 1 a
    # second position is nearly free); priced by the batch's widest row instead, one row's two drafts were charged
    # as if every row of the batch checked three positions
    row_costs: dict[int, float] = field(default_factory=dict)
    # batch size → decayed sums behind row_costs, a least-squares slope through the origin of a check's extra time (in
    # row shares) on its extra positions (Σxy, Σx²): a check with one extra position is little evidence (at batch 16
    # the ±5 % a step's time wanders is ±0.8 of a row share), one with sixteen is much
    row_sums: dict[int, tuple[float, float]] = field(default_factory=dict)
    # price checks at a batch by row_costs: off by default — with it (and context drafts in the gate's plain windows)
    # the adaptive default at batch 16 ran 0.88-0.91x the base against 0.98-1.04x without (Zen 4, 19:47-19:51, two
    # pairs): it drafted tails for a few rows at a time, whose lone draft passes cost 0.9-1.6 of a step
    use_row_costs: bool = False

    def observe_check(self, batch: int, positions: int, seconds: float, num_rows: int | None = None) -> None:
        """A check of ``batch`` sequences, the widest ``positions`` wide, ``num_rows`` positions in all (default: as
        if every sequence were that wide)."""
        counted = self._mean(self.checks, (batch, positions), seconds, (batch, 1))
        rows = batch * positions if num_rows is None else num_rows
        unit = self.checks.get((batch, 1))
        if not counted or batch <= 1 or rows <= batch or unit is None:
            return
        # a ratio to the one-position check, so the machine's drifting speed cancels
        x, y = rows - batch, (seconds / unit - 1) * batch
        xy, xx = self.row_sums.get(batch, (0.0, 0.0))
        xy, xx = self.decay * xy + x * y, self.decay * xx + x * x
        self.row_sums[batch] = (xy, xx)
        self.row_costs[batch] = xy / xx

    def observe_draft(self, batch: int, seconds: float, running: int | None = None) -> None:
        """A draft pass of ``batch`` rows while ``running`` sequences (default: those rows) share the steps."""
        if not self._mean(self.drafts, batch, seconds, (running or batch, 1)):
            return
        old = self.draft_rows
        self.draft_rows = batch if old is None else self.decay * old + (1 - self.decay) * batch

    def tail_share(self, batch: int, unit: float) -> float:
        """One drafting row's tail, in units of its share (``unit / batch``) of the batch's one-position check.

        A draft pass runs only the rows that draft at that moment (``draft_rows`` of them on average, often a
        few of many when a batch is out of phase), and every other row waits for it: each of its rows costs
        the pass's seconds ÷ its rows, times the batch. At batch 16 here a lone row's tail costs a few of its
        own steps, where at batch 1 it costs about half of one."""
        if not self.drafts:
            return self.tail_prior
        d = max(1, min(batch, round(self.draft_rows if self.draft_rows is not None else batch)))
        size = min(self.drafts, key=lambda k: (abs(k - d), k))  # the measured pass size nearest d
        return self._now(self.drafts, size) / d * batch / unit

    def _tag(self, table: dict[Any, float], key: Any) -> tuple[str, Any]:
        return ("check" if table is self.checks else "draft", key)

    def _now(self, table: dict[Any, float], key: Any) -> float:
        """An entry's seconds at the machine's current speed (scaled by its one-position check's drift)."""
        ref = self.units_at.get(self._tag(table, key))
        unit = None if ref is None else self.checks.get(ref[0])
        return table[key] if ref is None or unit is None else table[key] * unit / ref[1]

    def _mean(self, table: dict[Any, float], key: Any, seconds: float, unit_key: tuple[int, int]) -> bool:
        """Fold ``seconds`` into the running mean of ``key``; False for a warm-up pass, which is not counted."""
        tag = self._tag(table, key)
        n = self.seen[tag] = self.seen.get(tag, 0) + 1
        if n <= WARMUP_PASSES and key not in table:
            return False
        old = self._now(table, key) if key in table else None
        table[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        unit = self.checks.get(unit_key)
        if unit is not None and unit_key != key:
            self.units_at[tag] = (unit_key, unit)
        return True

    def cycle_cost(self, batch: int, num_drafts: int) -> float:
        """Cost of one row's cycle with ``num_drafts`` drafts, in units of that row's share of a one-position
        check at this batch size (a plain base step of the whole batch costs each row 1)."""
        unit = self.checks.get((batch, 1))
        if unit is None:
            return 1 + num_drafts * (self.check_prior_per_position + self.tail_prior)
        return self.check_cost(batch, num_drafts) + num_drafts * self.tail_share(batch, unit)

    def check_cost(self, batch: int, num_drafts: int) -> float:
        """A check of ``num_drafts`` drafts alone (no tail passes: context drafts), in the units of cycle_cost: at a
        batch of several, one row's share plus its extra positions at the measured marginal cost (``row_costs``);
        alone, the check of that width as measured (a second position can cost next to nothing or a weight pass)."""
        if self.use_row_costs and batch > 1 and batch in self.row_costs:
            return 1 + num_drafts * max(0.0, self.row_costs[batch])
        unit = self.checks.get((batch, 1))
        key = (batch, num_drafts + 1)
        if unit is None or key not in self.checks:
            return 1 + num_drafts * self.check_prior_per_position
        return self._now(self.checks, key) / unit


def count_cycle(drafted_by_pos: list[int], accepted_by_pos: list[int], num_drafts: int, num_accepted: int) -> None:
    """Add one checked cycle: its ``num_drafts`` positions drafted, the first ``num_accepted`` of them accepted."""
    for j in range(num_drafts):
        if j >= len(drafted_by_pos):
            drafted_by_pos.append(0)
            accepted_by_pos.append(0)
        drafted_by_pos[j] += 1
        accepted_by_pos[j] += j < num_accepted


def acceptance_by_pos(accepted_by_pos: list[int], drafted_by_pos: list[int], num_drafts: int,
                      prior: float | list[float] = PRIOR_ACCEPTANCE) -> list[float]:
    """Each position's acceptance ``a_j`` given the drafts before it were accepted, smoothed toward ``prior`` (one
    number, or one a position: the last one stands for the positions past it)."""
    out = []
    for j in range(num_drafts):
        p = prior if isinstance(prior, (int, float)) else prior[min(j, len(prior) - 1)] if prior else PRIOR_ACCEPTANCE
        acc = accepted_by_pos[j] if j < len(accepted_by_pos) else 0
        drafted = drafted_by_pos[j] if j < len(drafted_by_pos) else 0
        # a_j is conditional: draft j counts only in cycles that drafted it after j − 1 accepted drafts
        reached = drafted if j == 0 else min(drafted, accepted_by_pos[j - 1] if j - 1 < len(accepted_by_pos) else 0)
        out.append((acc + p * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT))
    return out


def expected_tokens(accepted_by_pos: list[int], drafted_by_pos: list[int], num_drafts: int,
                    prior: float | list[float] = PRIOR_ACCEPTANCE) -> float:
    """``1 + a_1 + a_1·a_2 + …`` over ``num_drafts`` positions, each ``a_j`` smoothed toward ``prior``."""
    total, run = 1.0, 1.0
    for a in acceptance_by_pos(accepted_by_pos, drafted_by_pos, num_drafts, prior):
        run *= a
        total += run
    return total


def worth_exploring(num_drafts: int, max_drafts: int, batch: int, costs: PassCosts, accepted_by_pos: list[int],
                    drafted_by_pos: list[int], prior: float = PRIOR_ACCEPTANCE) -> bool:
    """Whether drafting one more than ``num_drafts`` could pay at all: only if, with every draft accepted, it
    would beat the chosen count's expected rate. Exploring a draft that cannot pay only costs (at batch 16
    here a lone row's tail costs several of its steps)."""
    if num_drafts >= max_drafts:
        return False
    best = expected_tokens(accepted_by_pos, drafted_by_pos, num_drafts, prior) / costs.cycle_cost(batch, num_drafts)
    return (num_drafts + 2) / costs.cycle_cost(batch, num_drafts + 1) > best


def best_num_drafts(max_drafts: int, batch: int, costs: PassCosts, accepted_by_pos: list[int],
                    drafted_by_pos: list[int], prior: float = PRIOR_ACCEPTANCE) -> int:
    """The draft count in ``0..max_drafts`` with the most expected tokens per unit of cost."""
    best, best_rate = 0, 1.0 / costs.cycle_cost(batch, 0)
    for m in range(1, max_drafts + 1):
        rate = expected_tokens(accepted_by_pos, drafted_by_pos, m, prior) / costs.cycle_cost(batch, m)
        if rate > best_rate:
            best, best_rate = m, rate
    return best
