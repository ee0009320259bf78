"""The batch-level draft gate: drafts run at a batch size only while windows with them measured more tokens per
row-second than plain windows (torch-free; goodputs are given, not timed)."""

from __future__ import annotations

from dmtd.engine.draft_gate import FIRST_RETRY, WINDOW, DraftGate, bucket


def run_window(gate: DraftGate, batch: int, goodput: dict[bool, float]) -> bool:
    """One window of ``batch`` rows whose steps emit tokens at ``goodput[mode]`` per row-second."""
    mode = gate.begin_step(batch)
    for i in range(WINDOW):
        if i:
            assert gate.begin_step(batch) is mode  # a window keeps its mode
        gate.observe(batch, round(goodput[mode] * batch * 0.01), 0.01)
    return mode


def test_buckets():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64]


def test_one_sequence_always_drafts():
    gate = DraftGate()
    assert all(run_window(gate, 1, {True: 1.0, False: 100.0}) for _ in range(50))


def test_losing_drafts_are_turned_off_and_retried_rarely():
    gate = DraftGate()
    modes = [run_window(gate, 16, {True: 300.0, False: 600.0}) for _ in range(200)]
    assert modes[:2] == [False, True]  # both measured first
    assert sum(modes) <= 2 + 200 // FIRST_RETRY // 2  # then plain, drafts retried after 8, 16, 32, … windows
    assert not any(modes[2: 2 + FIRST_RETRY])


def test_paying_drafts_stay_on():
    gate = DraftGate()
    modes = [run_window(gate, 4, {True: 900.0, False: 600.0}) for _ in range(100)]
    assert sum(not m for m in modes) <= 1 + 100 // FIRST_RETRY // 2
    assert all(modes[2: 2 + FIRST_RETRY])


def test_the_verdict_follows_the_measurements():
    gate = DraftGate()
    for _ in range(40):
        run_window(gate, 8, {True: 300.0, False: 600.0})
    # the machine changes: drafts now pay; the next retry measures it and drafts win from then on
    modes = [run_window(gate, 8, {True: 900.0, False: 600.0}) for _ in range(80)]
    assert sum(modes[-40:]) >= 38  # drafts, but for a retry of plain steps now and then


def test_a_larger_batch_inherits_a_smaller_ones_loss():
    gate = DraftGate()
    for _ in range(4):
        run_window(gate, 16, {True: 300.0, False: 600.0})
    modes = [run_window(gate, 64, {True: 300.0, False: 600.0}) for _ in range(FIRST_RETRY)]
    assert not any(modes)  # no window of drafts at 64 before its first retry
    assert gate.decisions["neighbour"] == 1


def test_a_smaller_batch_does_not_inherit_a_larger_ones_loss():
    gate = DraftGate()
    for _ in range(4):
        run_window(gate, 64, {True: 300.0, False: 600.0})
    modes = [run_window(gate, 4, {True: 900.0, False: 600.0}) for _ in range(4)]
    assert modes[:2] == [False, True] and all(modes[2:])


def test_a_window_cut_by_a_new_batch_size_still_counts():
    gate = DraftGate()
    gate.begin_step(16)
    gate.observe(16, 16, 0.01)
    gate.begin_step(3)  # rows finished: the window at 16 closes with its one step
    assert gate.buckets[16].goodput[False] > 0
