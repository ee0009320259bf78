"""The engine thread's side of a replica's engine loop (a mixin of ``engine_loop.EngineLoop``, which owns the state
named here): its one-thread executor, the inbox the event loop stages work in, and the job loop that runs jobs
back to back and hands each result back (``engine_loop``'s docstring tells the whole design)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.serve.engine_job import Done, Job, encode_prompt, run_job
from dmtd_contract.records import ReplicaRequest

MAX_AHEAD = 2  # finished jobs that may wait for the event loop before the engine thread stops for it


def engine_executor() -> ThreadPoolExecutor:
    """The one thread an engine runs on (its construction, admissions, steps and tokenisation)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmtd-engine")


@dataclass
class Inbox:
    """What the event loop has staged for the engine thread's next job (read and written under the loop's lock;
    everything in it is built on the event loop, so the engine thread reads no event-loop state)."""
    aborts: list[str] = field(default_factory=list)
    admissions: list[tuple[str, int, float, SamplingParams]] = field(default_factory=list)
    requests: dict[str, ReplicaRequest] = field(default_factory=dict)  # of the admissions
    taus: dict[str, tuple[int, bool]] | None = None  # the controller's latest decision for every live request
    min_confidence: float = 0.0  # (its gate)

    def take(self) -> Job | None:
        """Everything staged, as one job, and empty again; None when nothing is staged."""
        if not self.aborts and not self.admissions and self.taus is None:
            return None
        job = Job(self.aborts, self.admissions, self.requests, self.taus or {}, self.min_confidence)
        self.aborts, self.admissions, self.requests, self.taus = [], [], {}, None
        return job


class LoopDied:
    """Queued by an engine-thread job loop that ended with an exception outside a job."""

    def __init__(self, error: Exception) -> None:
        self.error = error


Result = tuple[Job, Done | Exception] | LoopDied  # a job and what it returned or raised


class EngineThread:
    """The engine thread's job loop (everything here but ``_kick`` runs on that thread; the shared state is read
    and written under ``_lock``)."""

    engine: LLMEngine
    _lock: threading.Lock
    _inbox: Inbox
    _results: deque[Result]
    _worker_on: bool
    _unfinished: bool
    _halted: bool
    _sink: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None
    _executor: ThreadPoolExecutor

    def _kick(self) -> None:
        """Submit the engine thread's job loop unless it runs or has nothing to do (called under the lock)."""
        if self._worker_on or self._halted or len(self._results) >= MAX_AHEAD:
            return
        inbox = self._inbox
        if self._unfinished or inbox.aborts or inbox.admissions or inbox.taus is not None:
            self._executor.submit(self._job_loop)
            self._worker_on = True

    def _job_loop(self) -> None:
        """On the engine's thread: jobs back to back, each with what was staged while the last one ran, as long
        as the engine has unfinished requests or anything is staged (and fewer than ``MAX_AHEAD`` results wait
        for the event loop); then it returns, and the next staging submits it again."""
        try:
            while True:
                with self._lock:
                    job = None
                    if not self._halted and len(self._results) < MAX_AHEAD:
                        job = self._inbox.take()
                        if job is None and self._unfinished:
                            job = Job([], [], {}, {}, 0.0)
                    if job is None:
                        self._worker_on = False
                        return
                result: Done | Exception
                try:
                    result = self._engine_work(job)
                except Exception as e:  # an engine bug: the event loop fails the live requests
                    result = e
                with self._lock:
                    if isinstance(result, Exception):
                        self._unfinished, self._halted = False, True  # until the event loop has seen it
                    else:
                        self._unfinished = result.unfinished
                    self._deliver((job, result))
        except Exception as e:  # a bug of this loop: the event loop's side ends too, and its supervisor
            with self._lock:    # restarts both
                self._worker_on = False
                self._deliver(LoopDied(e))

    def _deliver(self, result: Result) -> None:
        """Queue a finished job for the event loop and wake it if it may wait (called under the lock)."""
        self._results.append(result)
        if len(self._results) == 1 and self._sink is not None:
            loop, ready = self._sink
            with contextlib.suppress(RuntimeError):  # a closed loop: the next one takes the result
                loop.call_soon_threadsafe(ready.set)

    def _engine_work(self, job: Job) -> Done:
        return run_job(self.engine, job, lambda req: encode_prompt(self.engine, req))
