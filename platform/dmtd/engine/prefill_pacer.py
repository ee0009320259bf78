"""How much prompt a prefill step takes while other sequences decode (torch-free).

A prompt's prefill steps alternate with the running sequences' decode steps, so every prefill step is a gap in
their streams. Where prompts run as rows (:meth:`dmtd.engine.prefill.PrefillRunner.rows_prefill`: a position's bits do
not depend on how its prompt was split), a prefill step takes the prompt positions that fit a time budget — about
``prefill_pace`` times the running sequences' decode step — measured, not guessed: a position costs a fixed part
(its products) and a part growing with the keys it reads, so a step late in a long prompt takes few positions and
one early in it many. A running stream's gap then stays near ``1 + prefill_pace`` of its steady one however long
the prompt that arrives (the scheduler's fixed chunks of ``prefill_chunk`` positions cost ~0.75 s each late in a
4,096-token prompt on two cores). Once a cycle the prompt rows ride on a step the running rows take anyway (a check,
a head step: :data:`CARRIERS`), sharing its weight reads, and the other rows wait for no step of the prompt's own.
Without rows (SDPA chunks, whose bits depend on their boundaries) the scheduler keeps whole chunks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["CARRIERS", "MAX_PACE", "ROW_KEYS", "PrefillPacer", "end_within", "prompt_cost"]

# the most a step's pace rises while prompts wait (PrefillPacer.share): a stream's gap stays under ~1 + MAX_PACE steps
MAX_PACE = 8.0
# the steps prompt rows ride on, one a cycle: an exact batch's check pass, and a step where rows of the unverified
# profile reach their heads (every layer group runs: the prompt rows share each one's weight reads)
CARRIERS = ("check", "head")
# a prompt position's work beside its attention, in keys read: on two cores of the AMX Xeon (bf16, exact profile)
# a position cost ~0.31 ms plus ~0.97 µs a key (4,096- and 1,024-token prompts prefilled alone)
ROW_KEYS = 320


def prompt_cost(start: int, end: int) -> float:
    """The work of prompt positions ``start .. end - 1`` in keys read (each reads the keys up to itself)."""
    n = end - start
    return n * ROW_KEYS + (start + end + 1) * n / 2


def end_within(start: int, target: int, units: float) -> int:
    """The furthest end in ``start + 1 .. target`` whose positions from ``start`` cost at most ``units`` (at least
    one position: a prompt always moves)."""
    b = ROW_KEYS + start + 0.5  # cost(n) = n² / 2 + b·n
    n = int(math.sqrt(b * b + 2 * max(units, 0.0)) - b)
    while n > 1 and prompt_cost(start, start + n) > units:
        n -= 1
    while start + n + 1 <= target and prompt_cost(start, start + n + 1) <= units:
        n += 1
    return min(target, start + max(n, 1))


@dataclass(slots=True, kw_only=True)
class StepBudgets:
    """What a step may spend on prompts (the scheduler's input, :meth:`PrefillPacer.budgets`)."""

    free_split: bool = False  # a prompt may be split anywhere (prompts run as rows: the split changes no bits)
    prefill: float | None = None  # keys a prefill step may read while sequences decode (None: one chunk; < 0: none)
    ride: dict[str, float | None] = field(default_factory=dict)  # keys prompt rows may add to a carrier, by CARRIERS


class PrefillPacer:
    """When a prefill step runs while sequences decode, and how many keys (:func:`prompt_cost`) it may read.

    ``pace``: the time prefill steps may take per unit of decode steps' time (0: no pacing, the scheduler's
    alternating whole chunks). Decode steps run while a prompt waits earn credit; a prefill step runs once the
    credit covers a step's fixed cost (its weights read, its passes' overhead: about a decode step's on two cores),
    takes what the rest buys, and spends its measured time. With the exact profile's draft and check steps this is
    one prefill step a cycle rather than one after each step: a stream's gap holds one prefill step, not two. A
    prefill step's time is fitted as ``fixed + per_key · keys`` over the last paced steps (least squares; before
    two distinct ones, a cautious guess).

    Where the running rows' cycles have a carrier step (:data:`CARRIERS`), prompt rows ride on it instead of taking
    steps of their own: ``pace`` times the carrier's step time, fitted the same way over the rides.
    """

    def __init__(self, pace: float, window: int = 32) -> None:
        self.base_pace = pace
        self.pace = pace  # this step's: base_pace, or more while more prompts wait than sequences decode (share)
        self.credit_ms = 0.0
        # each carrier's step time without prompt rows (a moving average), and its rides: (keys, ms added)
        self.carrier_ms: dict[str, float | None] = dict.fromkeys(CARRIERS)
        self._rides: dict[str, deque[tuple[float, float]]] = {k: deque(maxlen=window) for k in CARRIERS}
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)  # paced prefill steps: (keys, ms)

    def budgets(self, free_split: bool, num_prompts: int, num_running: int) -> StepBudgets:
        """The next step's budgets, ``num_prompts`` waiting or partly prefilled beside ``num_running`` decoding (the
        ride budgets, each a least-squares fit over the rides, only while a prompt waits to ride)."""
        self.share(num_prompts, num_running)
        return StepBudgets(free_split=free_split, prefill=self.budget() if free_split else None,
                           ride={k: self.ride_budget(k) for k in CARRIERS} if num_prompts else {})

    def share(self, waiting: int, running: int) -> None:
        """This step's pace from the load: at least ``base_pace``, and ``waiting / running`` where more prompts wait
        for their first token than sequences decode — each request, waiting or decoding, gets a like share of the
        machine (a lone stream beside one long prompt keeps ``1 + base_pace`` of its gap; beside three waiting
        prompts it gives them three of its steps' time, at most ``MAX_PACE``)."""
        if self.base_pace > 0:
            self.pace = max(self.base_pace, min(waiting / max(running, 1), MAX_PACE))

    def observe_carrier(self, kind: str, ms: float, ride_keys: float) -> None:
        """A carrier step (:data:`CARRIERS`): without prompt rows it sets the carrier's step time; with them, what the
        step took beyond it is the rows' cost (fitted as ``fixed + per_key · keys``: a layer group the carrier's rows
        do not run — the thinking group on a tail step, the variant's decoding group of exact prompts — is a call of
        its own, its weights read once whatever the rows)."""
        if ride_keys <= 0:
            base = self.carrier_ms[kind]
            self.carrier_ms[kind] = ms if base is None else 0.8 * base + 0.2 * ms
        elif self.carrier_ms[kind] is not None:
            self._rides[kind].append((ride_keys, max(ms - self.carrier_ms[kind], 0.0)))  # type: ignore[operator]

    def ride_budget(self, kind: str) -> float | None:
        """Keys prompt rows may add to a ``kind`` carrier step: what ``pace`` times its step time buys (None: no
        pacing)."""
        if self.pace <= 0:
            return None
        fixed, per_key = _fit(self._rides[kind], 0.0, 1.5e-3)
        base = self.carrier_ms[kind]
        spend = self.pace * (base if base is not None else 10.0) - fixed
        return max(spend, 0.0) / per_key

    def observe_decode(self, ms: float, prompt_waiting: bool) -> None:
        """A decode step's time; it earns credit while a prompt waits for its prefill (else the credit resets), at
        most a few steps' worth (credit left unspent while prompts rode on checks buys no stall later)."""
        self.credit_ms = min(self.credit_ms + ms, 3 * ms) if prompt_waiting else 0.0

    def observe_prefill(self, keys: float, ms: float, paced: bool) -> None:
        """A prefill step's work and time; a paced one spends credit and feeds the fit."""
        if not paced:
            return
        self.credit_ms -= ms / self.pace
        if keys > 0:
            self._steps.append((keys, ms))

    def fit(self) -> tuple[float, float]:
        """(fixed ms, ms per key) of a prefill step."""
        return _fit(self._steps, 0.0, 2e-3)  # 2 µs a key: about twice what two cores of the AMX Xeon take

    def budget(self) -> float | None:
        """Keys the next prefill step may read while sequences decode; negative: not yet (decode first); None:
        no pacing."""
        if self.pace <= 0:
            return None
        fixed, per_key = self.fit()
        spend = self.pace * self.credit_ms - fixed
        return spend / per_key if spend >= 0 else -1.0


def _fit(obs: deque[tuple[float, float]], fixed: float, per_key: float) -> tuple[float, float]:
    """(fixed ms, ms per key) fitted to ``(keys, ms)`` observations by least squares, the fixed part at least 0 and
    the slope positive; the guesses until two distinct observations."""
    n = len(obs)
    if n >= 2:
        mx = sum(k for k, _ in obs) / n
        my = sum(t for _, t in obs) / n
        sxx = sum((k - mx) ** 2 for k, _ in obs)
        if sxx > 1e-9 * mx * mx:
            slope = sum((k - mx) * (t - my) for k, t in obs) / sxx
            if slope > 0:
                return max(0.0, my - slope * mx), slope
        return 0.0, max(my / mx, 1e-6)
    if n == 1:
        return 0.0, max(obs[0][1] / obs[0][0], 1e-6)
    return fixed, per_key
