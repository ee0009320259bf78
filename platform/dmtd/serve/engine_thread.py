"""The engine thread's side of a replica's engine loop (``EngineWorker``, owned by ``engine_loop.EngineLoop``): its
one-thread executor, the inbox the event loop stages work in, and the job loop that runs jobs back to back and hands
each result back (``engine_loop``'s docstring tells the whole design)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.serve.engine_job import Done, EngineCall, Job, encode_prompt, run_job
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
    calls: list[EngineCall] = field(default_factory=list)  # work on the engine itself (a variant loaded, let go)

    def take(self) -> Job | None:
        """Everything staged, as one job, and empty again; None when nothing is staged."""
        if not self.aborts and not self.admissions and self.taus is None and not self.calls:
            return None
        job = Job(aborts=self.aborts, admissions=self.admissions, requests=self.requests, taus=self.taus or {},
                  min_confidence=self.min_confidence, calls=self.calls)
        self.aborts, self.admissions, self.requests, self.taus, self.calls = [], [], {}, None, []
        return job


class LoopDied:
    """Queued by an engine-thread job loop that ended with an exception outside a job."""

    def __init__(self, error: Exception) -> None:
        self.error = error


Result = tuple[Job, Done | Exception] | LoopDied  # a job and what it returned or raised


class EngineWorker:
    """The engine thread's job loop and what it shares with the event loop (everything here but :meth:`kick` runs on
    the engine thread; the shared state is read and written under ``lock``)."""

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.executor = executor
        # shared with the event loop, under lock: the staged work, the finished jobs the event loop has not taken
        # yet (kept here, not in the loop task, so that a restarted loop collects them), whether the job loop is
        # submitted, whether the engine had unfinished requests after its last job, whether it waits for the event
        # loop to see a failed step, and where to signal a finished job
        self.lock = threading.Lock()
        self.inbox = Inbox()
        self.results: deque[Result] = deque()
        self.running = False
        self.unfinished = False
        self.halted = False
        self.sink: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def kick(self) -> None:
        """Submit the engine thread's job loop unless it runs or has nothing to do (called under ``lock``, on the event
        loop or by the job loop)."""
        if self.running or self.halted or len(self.results) >= MAX_AHEAD:
            return
        inbox = self.inbox
        if self.unfinished or inbox.aborts or inbox.admissions or inbox.taus is not None or inbox.calls:
            self.executor.submit(self._job_loop)
            self.running = True

    def _job_loop(self) -> None:
        """On the engine's thread: jobs back to back, each with what was staged while the last one ran, as long
        as the engine has unfinished requests or anything is staged (and fewer than ``MAX_AHEAD`` results wait
        for the event loop); then it returns, and the next staging submits it again."""
        try:
            while True:
                with self.lock:
                    job = None
                    if not self.halted and len(self.results) < MAX_AHEAD:
                        job = self.inbox.take()
                        if job is None and self.unfinished:
                            job = Job(aborts=[], admissions=[], requests={}, taus={}, min_confidence=0.0)
                    if job is None:
                        self.running = False
                        return
                result: Done | Exception
                try:
                    result = self._engine_work(job)
                except Exception as e:  # an engine bug: the event loop fails the live requests
                    result = e
                with self.lock:
                    if isinstance(result, Exception):
                        self.unfinished, self.halted = False, True  # until the event loop has seen it
                    else:
                        self.unfinished = result.unfinished
                    self._deliver((job, result))
        except Exception as e:  # a bug of this loop: the event loop's side ends too, and its supervisor
            with self.lock:    # restarts both
                self.running = False
                self._deliver(LoopDied(e))

    def _deliver(self, result: Result) -> None:
        """Queue a finished job for the event loop and wake it if it may wait (called under the lock)."""
        self.results.append(result)
        if len(self.results) == 1 and self.sink is not None:
            loop, ready = self.sink
            with contextlib.suppress(RuntimeError):  # a closed loop: the next one takes the result
                loop.call_soon_threadsafe(ready.set)

    def _engine_work(self, job: Job) -> Done:
        return run_job(self.engine, job, lambda req: encode_prompt(self.engine, req))
