"""A stream kept in flight over gRPC while hostile requests go in: it must keep producing blocks."""

from __future__ import annotations

import statistics
import threading
import time

import grpc

from dmtd.client import DMTDClient

INTERNAL_NAMES = ("max_new_tokens", "sampling.", "cycle.", "chat.messages")  # never in an OpenAI API error


class Heartbeat:
    """Streams long greedy requests back to back, recording when each block arrives."""

    def __init__(self, target: str, max_new_tokens: int = 600) -> None:
        self.target, self.max_new_tokens = target, max_new_tokens
        self.times: list[float] = []
        self.errors: list[str] = []
        self.streams = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        assert self.wait_for_blocks(3, 120.0), f"heartbeat stream never started: {self.errors}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with DMTDClient(self.target) as c:
            while not self._stop.is_set():
                self.streams += 1
                try:
                    for _ in c.generate(prompt="Count slowly from one to one thousand:", ignore_eos=True,
                                        max_new_tokens=self.max_new_tokens, tau_min=1, tau_max=1, timeout_s=600):
                        with self._lock:
                            self.times.append(time.monotonic())
                        if self._stop.is_set():
                            break
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}")
                    time.sleep(0.2)

    def wait_for_blocks(self, n: int, timeout_s: float) -> bool:
        target = len(self.times) + n
        deadline = time.monotonic() + timeout_s
        while len(self.times) < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def median_interval_s(self) -> float:
        with self._lock:
            t = list(self.times)
        gaps = [b - a for a, b in zip(t, t[1:])]
        return statistics.median(gaps) if gaps else 0.1

    def gaps_since(self, t0: float) -> list[float]:
        """Intervals between consecutive blocks (and from ``t0`` to the first) after ``t0``."""
        with self._lock:
            t = [x for x in self.times if x >= t0]
        return [b - a for a, b in zip([t0, *t], t)]

    def assert_advances(self, since: float, budget_s: float) -> float:
        """A block arrived after ``since`` within ``budget_s``; returns how long it took."""
        deadline = since + budget_s
        while True:
            with self._lock:
                after = [x for x in self.times if x > since]
            if after:
                return after[0] - since
            assert time.monotonic() < deadline, (f"the in-flight stream stalled: no block for {budget_s:.1f} s "
                                                 f"(errors: {self.errors})")
            time.sleep(0.005)


def budget(hb: Heartbeat) -> float:
    """How long the in-flight stream may go without a block: its normal interval, with room for a shared CPU."""
    return max(2.0, 12 * hb.median_interval_s())
