"""Whether drafts may run at all at the batch's size: the tokens a row gets per second, measured over windows of
steps with drafts and windows without, per batch size.

The draft policy (:mod:`dmtd.engine.draft_policy`) prices one row's drafts from per-pass costs. In a batch that is
not enough: rows out of phase split every step into a draft pass and a check pass, each reading all the weights,
and a check of half the rows costs about what a check of all of them does. Measured at batch 16 (bf16, AMX): the
per-row policy drafted every other step on every row and the batch decoded 0.55× the base alone. vLLM's dynamic
speculative decoding answers the same question the same way, by goodput at the batch size. Here the answer is
measured, not modelled: windows of ``WINDOW`` steps run with drafts (the policy's choices) or as plain base steps,
and each window's tokens per row-second are kept per batch size. The better mode runs; the other is tried again
after a doubling number of windows (8, 16, …), so a lost bet costs a few per cent of the steps. A batch size
never measured takes the verdict of its neighbours where they imply one (drafts that lost at a smaller batch lose
at a larger one: a wider batch only makes the weights' reads cheaper per row, the drafts' cost stays), else it
measures both. One sequence alone always drafts: its per-row costs are the batch's. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 4  # steps per measured window
FIRST_RETRY = 8  # windows before the losing mode is measured again (then 16, 32, … up to MAX_RETRY)
MAX_RETRY = 256
DECAY = 0.5  # weight of the older goodput when a window follows one of the same mode (else it replaces it)


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, … (the next power of two)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass(slots=True)
class _Bucket:
    goodput: dict[bool, float] = field(default_factory=dict)  # drafts on / off → tokens per row-second
    retry: int = FIRST_RETRY  # windows of the winning mode before the other is measured again
    since: int = 0  # windows of the winning mode since the other was last measured
    implied: bool | None = None  # the neighbours' verdict, where the bucket was first met after them
    last: bool | None = None  # the mode of the bucket's latest window
    winner: bool | None = None


@dataclass(slots=True)
class DraftGate:
    """Per batch size: run drafts or plain steps, whichever measured more tokens per row-second."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)
    mode: bool = True  # drafts allowed in the current window
    _key: int = 1
    _left: int = 0  # steps left in the current window
    _tokens: int = 0
    _row_seconds: float = 0.0
    decisions: dict[str, int] = field(default_factory=dict)  # why each window ran as it did (metrics, tests)

    def allows(self) -> bool:
        """Whether the current window lets a row draft (the policy still chooses how many)."""
        return self.mode

    def begin_step(self, batch: int) -> bool:
        """Set the mode for a decode step of ``batch`` rows; a new window starts when the last ended or the batch
        moved to another size."""
        key = bucket(batch)
        if batch <= 1:
            self._close()
            self.mode, self._key, self._left = True, key, 0
            return True
        if self._left > 0 and key == self._key:
            return self.mode
        self._close()
        self.mode, reason = self._decide(key)
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        self._key, self._left = key, WINDOW
        return self.mode

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """A decode step of ``batch`` rows emitted ``tokens`` in ``seconds``."""
        if batch <= 1 or self._left <= 0 or bucket(batch) != self._key:
            return
        self._tokens += tokens
        self._row_seconds += seconds * batch
        self._left -= 1
        if self._left == 0:
            self._close()

    def _close(self) -> None:
        """Fold the current window's goodput into its bucket (a window cut short counts if it ran a step)."""
        if self._row_seconds > 0 and self._key > 1:
            b = self.buckets.setdefault(self._key, _Bucket())
            g = self._tokens / self._row_seconds
            old = b.goodput.get(self.mode) if b.last == self.mode else None  # a retry's window replaces
            b.goodput[self.mode] = g if old is None else DECAY * old + (1 - DECAY) * g
            b.last = self.mode
        self._tokens, self._row_seconds, self._left = 0, 0.0, 0

    def _decide(self, key: int) -> tuple[bool, str]:
        b = self.buckets.setdefault(key, _Bucket())
        on, off = b.goodput.get(True), b.goodput.get(False)
        if on is not None and off is not None:
            return self._winner_or_retry(b, on > off)
        if on is None and off is None:
            b.implied = self._implied(key)
            if b.implied is None:
                return False, "measure plain"
            return b.implied, "neighbour"
        known = on is not None
        if b.implied == known:  # the neighbours' verdict runs until its retry measures the other mode
            return self._winner_or_retry(b, known)
        return not known, "measure plain" if known else "measure drafts"

    def _winner_or_retry(self, b: _Bucket, winner: bool) -> tuple[bool, str]:
        if winner != b.winner:  # a new verdict: the other mode is retried soon again
            b.winner, b.retry, b.since = winner, FIRST_RETRY, 0
        b.since += 1
        if b.since > b.retry:
            b.since = 0
            b.retry = min(2 * b.retry, MAX_RETRY)
            return not winner, "retry"
        return winner, "drafts pay" if winner else "plain pays"

    def _implied(self, key: int) -> bool | None:
        """Plain where drafts lost at a smaller batch size; drafts where they won at a larger one."""
        for k, b in self.buckets.items():
            on, off = b.goodput.get(True), b.goodput.get(False)
            if not on or not off:
                continue
            if k < key and on < off:
                return False
            if k > key and on > off:
                return True
        return None
