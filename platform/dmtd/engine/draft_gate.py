"""Whether drafts may run at all at the batch's size: the tokens a row gets per second in a window of steps with drafts
against the window of plain steps beside it, per batch size.

The draft policy (:mod:`dmtd.engine.draft_policy`) prices one row's drafts from per-pass costs. In a batch that is
not enough: rows out of phase split every step into a draft pass and a check pass, each reading all the weights, and
a check of half the rows costs about what a check of all of them does. Measured at batch 16 (bf16, AMX): the per-row
policy drafted every other step on every row and the batch decoded 0.55× the base alone. vLLM's dynamic speculative
decoding answers the same question the same way, by goodput at the batch size. Here the answer is measured, not
modelled: windows of ``WINDOW`` steps run with drafts (the policy's choices) or as plain base steps, and a window of
one mode between two windows of the other (at the same batch size) gives one reading of drafts' goodput ÷ plain
goodput. A window's mode holds for every row from its first step (rows between two cycles take it at once,
:meth:`dmtd.engine.verified.VerifiedCycles.switch`), and a window of drafts ends on a step where no row holds drafts
still to check, so each window's tokens are those its own steps made. Readings are sandwiched because the machine's
speed drifts: on the 2-core machines here by ±30 % over seconds, and a drafts window compared with a plain goodput
measured seconds earlier read a loss of 0.5× as a win (the exact default then drafted at batch 16 at 0.6× the base
alone). The verdict is the median of the last ``READINGS`` readings, so one window that ran in a fast or slow moment
does not turn it: a first measurement alternates the modes until two readings agree (or a third decides), and a
retry whose reading disagrees with the verdict is confirmed by another at once.

The better mode runs; the other is tried again after a number of windows priced by how much it lost, doubling from
there: a retry's window costs the time it runs behind — 1 − the ratio, for as long as it lasts against a window of
the winner (a window of drafts after plain steps first catches every row's tail path up, and at batch 64 lasted 8× a
plain one) — and the windows before it are as many as keep that under ``RETRY_BUDGET`` of the time (at least 8;
drafts at half the plain rate in windows as long as plain ones are retried after 50 windows, then 100, …). A batch
size never measured takes the verdict of its neighbours where they imply one (drafts that lost at a smaller batch
lose at a larger one: a wider batch only makes the weights' reads cheaper per row, the drafts' cost stays), else it
measures. Only steps where some row could draft count (``LLMEngine`` skips the gate on the others: τ = 1 rows and
unverified ones run the same steps in either mode). One sequence alone always drafts: its per-row costs are the
batch's. Torch-free.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

WINDOW = 4  # steps per measured window
MAX_WINDOW = 16  # the most steps a window of drafts runs on while its rows' drafts wait for their check
FIRST_RETRY = 8  # the fewest windows before the losing mode is measured again (then twice as many, … up to MAX_RETRY)
MAX_RETRY = 256
RETRY_BUDGET = 0.01  # the share of the time a verdict's first retry may cost, at the loser's measured loss
READINGS = 3  # the readings a verdict is the median of


def first_retry(cost: float) -> int:
    """Windows of the winner before the loser is measured again, where a window of the loser costs ``cost`` windows
    of the winner's time (:meth:`_Bucket.cost`): kept under ``RETRY_BUDGET`` of the windows it follows."""
    return min(MAX_RETRY, max(FIRST_RETRY, math.ceil(cost / RETRY_BUDGET)))


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, … (the next power of two)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass(slots=True)
class _Bucket:
    goodput: dict[bool, float] = field(default_factory=dict)  # drafts on / off → the latest window's tokens/row-s
    seconds: dict[bool, float] = field(default_factory=dict)  # drafts on / off → the latest window's wall seconds
    windows: list[tuple[bool, float]] = field(default_factory=list)  # the last three windows: (mode, goodput)
    readings: list[float] = field(default_factory=list)  # drafts ÷ plain, one per window between two of the other
    retry: int = FIRST_RETRY  # windows of the winning mode before the other is measured again
    since: int = 0  # windows of the winning mode since the other was last measured
    implied: bool | None = None  # the neighbours' verdict, where the bucket was first met after them
    implied_ratio: float = 1.0  # that neighbour's ratio (prices the first retry)
    implied_span: float = 1.0  # that neighbour's window of the losing mode ÷ of the winning one, in time
    last: bool | None = None  # the mode of the bucket's latest window
    winner: bool | None = None
    retrying: bool = False  # a retry's window ran: the next reading is the retry's
    confirm: bool = False  # the latest retry's reading disagreed with the verdict: measure the loser once more

    @property
    def ratio(self) -> float | None:
        """Drafts' goodput ÷ plain goodput: the median of the readings (None before the first)."""
        if not self.readings:
            return None
        return math.exp(statistics.median(math.log(r) for r in self.readings))

    def settled(self) -> bool:
        """Two readings that agree on the winner, or three."""
        r = self.readings
        return len(r) >= READINGS or (len(r) == 2 and (r[0] > 1) == (r[1] > 1))

    def add(self, mode: bool, goodput: float, seconds: float) -> float | None:
        """Keep a window; returns the reading it completes (its predecessor between it and the one before)."""
        self.goodput[mode] = goodput
        self.seconds[mode] = seconds
        w = self.windows = [*self.windows[-2:], (mode, goodput)]
        if len(w) < 3 or not (w[0][0] == w[2][0] != w[1][0]) or min(g for _, g in w) <= 0:
            return None
        around = math.sqrt(w[0][1] * w[2][1])
        reading = w[1][1] / around if w[1][0] else around / w[1][1]
        self.readings = [*self.readings[-(READINGS - 1):], reading]
        return reading

    def loss(self) -> float:
        """The losing mode's goodput ÷ the winning one's (≤ 1): measured here where a reading is, else the
        neighbour's."""
        r = self.ratio if self.ratio is not None else self.implied_ratio
        return min(r, 1 / r) if r > 0 else 0.0

    def cost(self, winner: bool) -> float:
        """What a window of the losing mode costs, in windows of the winner's time: it runs ``1 − loss`` behind for
        as long as it lasts. A window of drafts after plain steps first catches every row's tail path up on the
        positions since, and at batch 64 lasted 8× a plain window (goodput 0.12×): priced as one window, its
        retries every 64 windows cost ~11 % of the time, not the 1 % budgeted."""
        return (1 - self.loss()) * self.span(winner)

    def span(self, winner: bool) -> float:
        """The latest window of the losing mode ÷ the winning one's, in seconds (the neighbour's before both ran
        here)."""
        t_loser, t_winner = self.seconds.get(not winner, 0.0), self.seconds.get(winner, 0.0)
        return t_loser / t_winner if t_loser > 0 and t_winner > 0 else self.implied_span


@dataclass(slots=True)
class DraftGate:
    """Per batch size: run drafts or plain steps, whichever measured more tokens per row-second."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)
    mode: bool = True  # drafts allowed in the current window
    switched: bool = False  # the latest step began a window of the other mode (VerifiedCycles.switch)
    _key: int = 1
    _open: bool = False  # a window is running
    _steps: int = 0  # steps measured in it
    _tokens: int = 0
    _seconds: float = 0.0
    _row_seconds: float = 0.0
    decisions: dict[str, int] = field(default_factory=dict)  # why each window ran as it did (metrics, tests)

    def allows(self) -> bool:
        """Whether the current window lets a row draft (the policy still chooses how many)."""
        return self.mode

    def begin_step(self, batch: int) -> bool:
        """Set the mode for a decode step of ``batch`` rows; a new window starts when the last ended or the batch
        moved to another size (``switched`` tells whether it changed the mode)."""
        key = bucket(batch)
        before, self.switched = self.mode, False
        if batch <= 1:
            self._close()
            self.mode, self._key = True, key
            return True
        if self._open and key == self._key:
            return self.mode
        self._close()
        self.mode, reason = self._decide(key)
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        self._key, self._open, self.switched = key, True, self.mode != before
        return self.mode

    def observe(self, batch: int, tokens: int, seconds: float, settled: bool = True) -> None:
        """A decode step of ``batch`` rows emitted ``tokens`` in ``seconds``; ``settled``: no row holds drafts
        that wait for a check. A window of drafts ends on a settled step (or after ``MAX_WINDOW``), so that its
        drafts' tokens and the passes that made them count in the same window: windows cut at a fixed step count
        credited a drafts window's last drafts to the plain window after it, and at batch 16 read drafts at 0.87x
        the plain goodput as 1.04-1.16x (the exact default then drafted at 0.65x the base alone)."""
        if batch <= 1 or not self._open or bucket(batch) != self._key:
            return
        self._tokens += tokens
        self._seconds += seconds
        self._row_seconds += seconds * batch
        self._steps += 1
        if self._steps >= WINDOW and (settled or not self.mode or self._steps >= MAX_WINDOW):
            self._close()

    def _close(self) -> None:
        """Keep the current window's goodput (a window cut short counts if it ran a step)."""
        if self._row_seconds > 0 and self._key > 1:
            b = self.buckets.setdefault(self._key, _Bucket())
            reading = b.add(self.mode, self._tokens / self._row_seconds, self._seconds)
            if reading is not None and b.retrying:  # a retry that disagrees is measured once more at once
                b.confirm = (reading > 1) != b.winner and not b.confirm
                b.retrying = b.confirm
            b.last = self.mode
        self._tokens, self._seconds, self._row_seconds, self._open, self._steps = 0, 0.0, 0.0, False, 0

    def _decide(self, key: int) -> tuple[bool, str]:
        b = self.buckets.setdefault(key, _Bucket())
        if b.readings and b.settled():
            if b.confirm and b.last == b.winner:
                b.retrying = True
                return not b.winner, "confirm"
            return self._winner_or_retry(b, b.ratio is not None and b.ratio > 1)
        if b.last is None and b.implied is None:
            b.implied, b.implied_ratio, b.implied_span = self._implied(key)
            if b.implied is not None:
                b.winner, b.retry, b.since = b.implied, first_retry(b.cost(b.implied)), 0
                return b.implied, "neighbour"
        if b.implied is not None and not b.readings and (b.last is None or b.last == b.implied):
            return self._winner_or_retry(b, b.implied)  # the neighbours' verdict runs until its retry measures
        if b.last is None:
            return False, "measure plain"
        return not b.last, "measure plain" if b.last else "measure drafts"  # alternate until the readings settle

    def _winner_or_retry(self, b: _Bucket, winner: bool) -> tuple[bool, str]:
        if winner != b.winner:  # a new verdict: the other mode is retried as soon as its loss affords
            b.winner, b.retry, b.since = winner, first_retry(b.cost(winner)), 0
        b.since += 1
        if b.since > b.retry:
            b.since = 0
            b.retry = min(2 * b.retry, MAX_RETRY)
            b.retrying = True
            return not winner, "retry"
        return winner, "drafts pay" if winner else "plain pays"

    def _implied(self, key: int) -> tuple[bool | None, float, float]:
        """Plain where drafts lost at a smaller batch size; drafts where they won at a larger one (with that
        size's ratio and windows' span, which price the first retry)."""
        for k, b in self.buckets.items():
            r = b.ratio
            if r is None or not b.settled():
                continue
            if k < key and r < 1:
                return False, r, b.span(False)
            if k > key and r > 1:
                return True, r, b.span(True)
        return None, 1.0, 1.0
