"""The batch-level draft gate: drafts run at a batch size only while windows with them measured more tokens per
row-second than the plain windows around them (torch-free; goodputs are given, not timed)."""

from __future__ import annotations

from dmtd.engine.draft_gate import (
    FIRST_RETRY,
    MAX_WINDOW,
    RETRY_BUDGET,
    WINDOW,
    DraftGate,
    bucket,
    first_retry,
)


def run_window(gate: DraftGate, batch: int, goodput: dict[bool, float],
               step_s: dict[bool, float] | None = None) -> bool:
    """One window of ``batch`` rows whose steps emit tokens at ``goodput[mode]`` per row-second (each step
    ``step_s[mode]`` seconds, 0.01 by default)."""
    mode = gate.begin_step(batch)
    dt = (step_s or {}).get(mode, 0.01)
    for i in range(WINDOW):
        if i:
            assert gate.begin_step(batch) is mode  # a window keeps its mode
        gate.observe(batch, round(goodput[mode] * batch * dt), dt)
    return mode


def test_buckets():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64]


def test_one_sequence_always_drafts():
    gate = DraftGate()
    assert all(run_window(gate, 1, {True: 1.0, False: 100.0}) for _ in range(50))


def test_losing_drafts_are_turned_off_and_retried_rarely():
    gate = DraftGate()
    modes = [run_window(gate, 16, {True: 300.0, False: 600.0}) for _ in range(200)]
    assert modes[:4] == [False, True, False, True]  # both measured first, alternately, until two readings agree
    assert sum(modes) <= 2 + 200 // FIRST_RETRY // 2  # then plain, drafts retried after 8, 16, 32, … windows
    assert not any(modes[4: 4 + FIRST_RETRY])


def test_a_retry_waits_as_long_as_the_losers_loss_makes_it_cost():
    assert first_retry(0.01) == FIRST_RETRY  # a near tie: retried soon
    assert first_retry(0.5) == round(0.5 / RETRY_BUDGET)  # half the rate: a retry window costs half a window
    gate = DraftGate()
    modes = [run_window(gate, 16, {True: 300.0, False: 600.0}) for _ in range(200)]
    retries = [i for i, m in enumerate(modes) if m and i > 3]
    assert retries[0] == 4 + first_retry(0.5)  # the first retry after the priced number of windows, not after 8
    cost = sum(0.5 for i in retries) / len(modes)  # each window of drafts lost half a window
    assert cost <= 2 * RETRY_BUDGET
    close = DraftGate()
    modes = [run_window(close, 16, {True: 590.0, False: 600.0}) for _ in range(4 + FIRST_RETRY + 1)]
    assert modes[-1]  # drafts 2 % behind are retried after the fewest windows


def test_paying_drafts_stay_on():
    gate = DraftGate()
    modes = [run_window(gate, 4, {True: 900.0, False: 600.0}) for _ in range(100)]
    assert sum(not m for m in modes) <= 2 + 100 // FIRST_RETRY // 2
    assert all(modes[3: 3 + FIRST_RETRY])


def test_the_verdict_follows_the_measurements():
    gate = DraftGate()
    for _ in range(40):
        run_window(gate, 8, {True: 300.0, False: 600.0})
    # the machine changes: drafts now pay; the next retry measures it and drafts win from then on
    modes = [run_window(gate, 8, {True: 900.0, False: 600.0}) for _ in range(80)]
    assert sum(modes[-40:]) >= 38  # drafts, but for a retry of plain steps now and then
    assert gate.decisions["confirm"] == 1  # the retry that read drafts winning was measured once more first


def test_one_window_in_a_fast_moment_does_not_turn_the_verdict():
    """The machine's speed drifts (±30 % over seconds on the 2-core machines here): a retry window that runs in a
    fast moment reads drafts winning once; the confirmation beside it reads the loss again, and plain stays."""
    gate = DraftGate()
    modes = [run_window(gate, 16, {True: 300.0, False: 600.0}) for _ in range(4 + first_retry(0.5))]
    assert sum(modes) == 2  # the first measurement's two windows of drafts
    assert run_window(gate, 16, {True: 900.0, False: 600.0})  # the retry, in a fast moment: drafts read 1.5×
    after = [run_window(gate, 16, {True: 300.0, False: 600.0}) for _ in range(60)]
    assert after[:2] == [False, True] and not any(after[2:])  # its confirmation reads 0.5×: plain from then on
    assert gate.buckets[16].ratio < 1  # the median of the last readings: 1.5, 0.87 (plain between the two), 0.5


def test_readings_are_taken_between_windows_of_the_other_mode():
    """A slow spell that starts between the plain windows and the drafts window does not read as the drafts'
    loss: each reading divides a window by the geometric mean of the two around it."""
    gate = DraftGate()
    speed = iter([1.0, 1.0, 0.5, 0.5, 0.5] + [0.5] * 20)
    for _ in range(6):
        k = next(speed)
        run_window(gate, 16, {True: 600.0 * k, False: 600.0 * k})
    assert 0.6 < gate.buckets[16].ratio < 1.0 / 0.6  # equal modes read about equal though the speed halved


def test_a_larger_batch_inherits_a_smaller_ones_loss():
    gate = DraftGate()
    for _ in range(4):
        run_window(gate, 16, {True: 300.0, False: 600.0})
    modes = [run_window(gate, 64, {True: 300.0, False: 600.0}) for _ in range(first_retry(0.5) + 2)]
    assert not any(modes[:-1]) and modes[-1]  # no window of drafts at 64 before its first retry, priced by 16's loss
    assert gate.decisions["neighbour"] == 1


def test_a_smaller_batch_does_not_inherit_a_larger_ones_loss():
    gate = DraftGate()
    for _ in range(4):
        run_window(gate, 64, {True: 300.0, False: 600.0})
    modes = [run_window(gate, 4, {True: 900.0, False: 600.0}) for _ in range(6)]
    assert modes[:4] == [False, True, False, True] and all(modes[4:])


def test_a_window_cut_by_a_new_batch_size_still_counts():
    gate = DraftGate()
    gate.begin_step(16)
    gate.observe(16, 16, 0.01)
    gate.begin_step(3)  # rows finished: the window at 16 closes with its one step
    assert gate.buckets[16].goodput[False] > 0


def test_a_window_of_drafts_ends_on_the_step_that_checks_its_drafts():
    """A window of drafts runs past WINDOW steps while rows hold drafts not yet checked (their tokens belong to it),
    up to MAX_WINDOW; a plain window ends after WINDOW steps. ``switched`` marks the step that changed the mode."""
    gate = DraftGate()
    assert gate.begin_step(16) is False and gate.switched  # the first measurement, plain (drafts before)
    for i in range(WINDOW):
        assert gate.begin_step(16) is False and (not gate.switched or i == 0)
        gate.observe(16, 16, 0.01, settled=True)
    assert gate.begin_step(16) is True and gate.switched
    gate.observe(16, 0, 0.01, settled=False)
    for _ in range(WINDOW + 2):  # the rows draft on: no check yet
        assert gate.begin_step(16) is True and not gate.switched
        gate.observe(16, 0, 0.01, settled=False)
    gate.begin_step(16)
    gate.observe(16, 64, 0.01, settled=True)  # the check: the window closes with its drafts' tokens
    assert gate.buckets[16].goodput[True] == 64 / (16 * 0.01 * (WINDOW + 4))
    assert gate.begin_step(16) is False and gate.switched
    for _ in range(WINDOW):
        gate.observe(16, 16, 0.01, settled=True)
        gate.begin_step(16)
    assert gate.mode is True  # alternating until the readings settle
    for _ in range(MAX_WINDOW):  # rows that never all settle at once: the window still ends
        gate.observe(16, 8, 0.01, settled=False)
        gate.begin_step(16)
    assert gate.mode is False and gate.switched


def test_a_retry_is_priced_by_the_time_its_window_takes():
    """A window of drafts after plain steps first catches every row's tail path up (at batch 64 it lasted 8× a
    plain window): its retries are spaced by the time it loses, not by its window count."""
    plain_s = DraftGate()
    modes = [run_window(plain_s, 16, {True: 300.0, False: 600.0}) for _ in range(4 + first_retry(0.5) + 1)]
    assert modes[-1]  # drafts at half the rate, windows as long as plain ones: retried after 50 windows
    slow = DraftGate()
    step_s = {True: 0.04, False: 0.01}  # the same goodput, each drafts window four times as long
    modes = [run_window(slow, 16, {True: 300.0, False: 600.0}, step_s) for _ in range(4 + first_retry(2.0) + 1)]
    retries = [i for i, m in enumerate(modes) if m and i > 3]
    assert retries == [4 + first_retry(2.0)]  # after 200 windows: 4 × (1 − 0.5) windows' time lost a retry
    modes = [run_window(slow, 64, {True: 300.0, False: 600.0}, step_s) for _ in range(first_retry(2.0) + 2)]
    assert not any(modes[:-1]) and modes[-1]  # a larger batch inherits the verdict and its price
