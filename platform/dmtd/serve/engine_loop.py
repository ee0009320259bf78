"""The replica's engine loop: admissions, steps, block dispatch, the controller's τ and gate.

Only the engine's thread touches the engine, and it takes its jobs itself (vLLM v1's busy loop): the event
loop only *stages* work for it (admissions, each with its sampling parameters; aborts; the controller's τ and
gate for every live request) in an inbox under a lock, and the engine thread, after each job, takes what was
staged meanwhile and runs the next job at once (the aborts, the admissions, each prompt tokenised right before
it is added, the τ and gate, one step) as long as the engine has unfinished requests or anything is staged.
Each job's result (``Done``) goes back to the event loop through a deque and one ``call_soon_threadsafe``
wake-up; the event loop consumes them in order (admission bookkeeping, telemetry, dispatching the step's blocks,
the controller) while the engine computes the next step. So the engine never waits for the event loop between
steps: before, each step's result crossed to the event loop and the next job crossed back, 2–3 ms (median) of a
30 ms decode step with the event loop competing for two busy cores. At most ``MAX_AHEAD`` results wait for the
event loop; past that (an event loop that is gone or far behind) the engine thread stops until it catches up.

The engine thread reads none of the event loop's state (``live``, the controller): all it takes is built on the
event loop when staged. It is not a thread of its own that idles: when nothing is staged and no request is
unfinished, the job loop returns and its thread waits on the executor's queue; staging work submits the loop
again. One request's failure ends that request only (a step that raises fails the live requests, and the
engine thread waits until the event loop has staged their aborts); a supervisor restarts the event loop's side
if it ever ends, and a job loop that ends with an exception of its own ends the event loop's side too, so it is
restarted with it.

Every torch call of the replica runs on that one executor thread, the engine's construction included
(``DMTDReplica`` builds it there). OpenMP gives each thread that opens a parallel region a pool of its own;
with a second pool the process manages more OpenMP threads than there are cores, and libgomp then stops
spinning between parallel regions: every region pays a futex wake-up, which took a decode step on two cores
from 15 ms to 30 ms (docs/benchmarks.md, "The stack against the engine").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.serve.block_delivery import BlockDelivery
from dmtd.serve.controller import ControllerConfig, TauController
from dmtd.serve.engine_job import Done, EngineCall, Job, Live, Pushed, internal_error
from dmtd.serve.engine_thread import EngineWorker, LoopDied, engine_executor
from dmtd.serve.errors import Overloaded, ReplicaInternalError, RequestFailed
from dmtd.serve.push import BlockPusher
from dmtd.serve.requests import names_of, refused
from dmtd.telemetry.replica import ReplicaState, ReplicaTelemetry
from dmtd_contract.records import Block, ReplicaRequest

log = logging.getLogger("dmtd.replica")
T = TypeVar("T")

class EngineLoop:
    """Owns the engine; admits requests, consumes the engine thread's steps (its ``worker``, :class:`EngineWorker`),
    has their blocks delivered (its ``delivery``, :class:`BlockDelivery`), applies the controller's τ and gate."""

    def __init__(self, engine: LLMEngine, controller: TauController, max_queued: int, replica_name: str,
                 telemetry: ReplicaTelemetry | None = None, executor: ThreadPoolExecutor | None = None) -> None:
        self.engine, self.controller = engine, controller
        self.max_queued, self.replica_name = max_queued, replica_name
        self.live: dict[str, Live] = {}
        self._load = (0, 0)  # the engine's waiting and running requests after the last job consumed
        self.worker = EngineWorker(engine, executor or engine_executor())
        self.delivery = BlockDelivery(engine=engine, controller=controller, replica_name=replica_name,
                                      telemetry=telemetry, live=self.live, fail=self._fail)
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0
        self.restarts = 0

    @property
    def telemetry(self) -> ReplicaTelemetry | None:
        """The replica's telemetry, the block delivery's (one reference: a replica sets it after building the loop)."""
        return self.delivery.telemetry

    @telemetry.setter
    def telemetry(self, tel: ReplicaTelemetry | None) -> None:
        self.delivery.telemetry = tel

    @property
    def pusher(self) -> BlockPusher | None:
        """The replica's block pusher, for requests submitted with a sink (set by the replica)."""
        return self.delivery.pusher

    @pusher.setter
    def pusher(self, pusher: BlockPusher | None) -> None:
        self.delivery.pusher = pusher

    # -- bookkeeping visible to tests and metrics ----------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.live)

    def stats(self) -> dict[str, Any]:
        d = self.controller.decision
        return {"active": self.num_active, "running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "pending": len(self.worker.inbox.admissions),
                "tau": d.tau, "min_confidence": d.min_confidence, "reason": d.reason,
                "itl_p95_ms": self.controller.itl_p95_ms(), "steps": self.num_steps, "replica": self.replica_name,
                "loop_restarts": self.restarts, **self.engine.cache_report(),
                # the batch gate's windows by reason ("plain pays", "measure drafts", "retry", …; draft_gate.py)
                "gate_windows": dict(self.engine.cycles.draft_gate.decisions),
                # the engine's model passes by kind: [count, seconds] (LLMEngine.pass_stats)
                "passes": {k: list(v) for k, v in self.engine.pass_stats.items()}}

    def state(self) -> ReplicaState:
        """The gauges' reading (called from the metrics endpoint's thread: reads only)."""
        c, d, e = self.controller.cfg, self.controller.decision, self.engine
        cache = e.cache_report()
        return ReplicaState(queue_depth=e.num_waiting + len(self.worker.inbox.admissions), batch_size=e.num_running,
                            kv_occupancy=cache["kv_utilisation"],
                            prefix_hit_ratio=float(cache.get("prefix_hit_ratio", 0.0)),
                            tau=d.tau, tau_min=c.tau_min,
                            tau_max=c.tau_max, min_confidence=d.min_confidence)

    # -- requests ------------------------------------------------------------------------------
    def _bounds(self, req: ReplicaRequest) -> tuple[int, int]:
        c = self.controller.cfg
        lo, hi = c.tau_min, c.tau_max
        if req.profile == "quality":
            hi = max(lo, min(hi, c.rest_tau - 1))
        elif req.profile == "speed":
            lo = min(hi, max(lo, c.rest_tau + 1))
        if req.tau_min:
            lo = min(max(lo, req.tau_min), hi)
        if req.tau_max:
            hi = max(min(hi, req.tau_max), lo)
        return lo, hi

    async def submit(self, req: ReplicaRequest, stream_interval_ms: float = 0.0,
                     push: tuple[str, str] | None = None) -> AsyncGenerator[list[Block], None]:
        """Queue a request and yield its blocks, in order, as lists; cancelling the iteration frees its slot.

        With ``stream_interval_ms`` > 0, blocks that come sooner than that after the previous list wait for the
        rest of the interval and go together (one streamed item instead of several; Ray Serve LLM batches its
        streams the same way, every 50 ms). The first block and a request's last one never wait.

        With ``push`` (a sink address this loop's ``pusher`` is connected to, and the request's token), the
        loop writes the blocks to the sink itself, at most one frame per ``stream_interval_ms`` after the first
        (``BlockDelivery.flush``), every due request's frame of a step in one write, and this yields nothing;
        it ends after the last frame is written, or raises the request's error. If the connection is gone when
        a frame is due, the rest of the blocks are yielded here instead."""
        if len(self.live) >= self.engine.cfg.max_num_seqs + self.max_queued:
            raise Overloaded(retry_after_ms=max(50, int(self.controller.itl_p95_ms() * 32) or 500))
        if req.request_id in self.live:
            name = names_of(req).request_id
            raise RequestFailed(name, f"{name}: {req.request_id!r} is already in flight")
        lo, hi = self._bounds(req)
        live = Live(req=req, queue=asyncio.Queue(), tau_lo=lo, tau_hi=hi,
                    fixed_confidence=req.min_confidence is not None,
                    push=push if push is not None and self.pusher is not None else None,
                    interval_s=max(0.0, stream_interval_ms) / 1e3)
        live.t_admit_wall = time.time()  # until admitted: when the request reached this replica
        self.live[req.request_id] = live
        tel = self.telemetry
        if tel is not None:
            attrs: dict[str, Any] = {"dmtd.tau_bounds": f"{lo}..{hi}", "dmtd.max_new_tokens": req.max_new_tokens}
            if req.sent_s:
                attrs["dmtd.stage.ray_hop_ms"] = max(0.0, (live.t_admit_wall - req.sent_s) * 1e3)
            tel.on_arrival(req.request_id, req.traceparent, attrs)
        self._ensure_task()
        try:
            admission = self._params(req.request_id)  # (a malformed one fails here: its error is queued)
            if admission is not None:  # tokenised on the engine's thread, right before it is added
                with self.worker.lock:
                    self.worker.inbox.admissions.append(admission)
                    self.worker.inbox.requests[req.request_id] = req
                    self.worker.kick()
            interval_s, last_sent = max(0.0, stream_interval_ms) / 1e3, None
            while True:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Pushed):
                    return
                batch, pushed_end = [item], False
                if interval_s and last_sent is not None and not item.finish_reason:
                    wait = last_sent + interval_s - time.perf_counter()
                    if wait > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(live.last.wait(), wait)  # the last block goes at once
                    while not live.queue.empty() and not batch[-1].finish_reason:
                        more = live.queue.get_nowait()
                        if isinstance(more, BaseException):
                            raise more
                        if isinstance(more, Pushed):  # (a pushed request has no interval: never here)
                            pushed_end = True
                            break
                        batch.append(more)
                now, sent = time.perf_counter(), time.time()
                for b in batch:
                    b.dispatch_ms = (now - live.ready.popleft()) * 1e3 if live.ready else 0.0
                    b.sent_s = sent
                yield batch
                last_sent = time.perf_counter()
                if batch[-1].finish_reason or pushed_end:
                    return
        finally:
            self.delivery.holding.pop(req.request_id, None)
            if self.live.pop(req.request_id, None) is not None:
                # cancelled or failed mid-stream: the engine frees the slot before its next step
                self._stage_abort(req.request_id)
            if tel is not None:
                tel.on_finish(req.request_id, "abort")  # no-op when the request already finished

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine's thread between two steps (a variant loaded or let go): its result, or
        its error raised here; the streams in flight go on at the next step."""
        future: Future[T] = Future()
        self._ensure_task()
        with self.worker.lock:
            self.worker.inbox.calls.append(EngineCall(fn, future))
            self.worker.kick()
        return await asyncio.wrap_future(future)

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            loop, ready = asyncio.get_running_loop(), asyncio.Event()
            with self.worker.lock:
                self.worker.sink = (loop, ready)  # finished jobs are signalled to this loop from now on
            self._task = loop.create_task(self._supervise(ready))

    async def _supervise(self, ready: asyncio.Event) -> None:
        """Run the loop; if it ever ends with an exception, count it and start it again."""
        while True:
            try:
                await self._run(ready)
            except Exception:
                self.restarts += 1
                log.exception("engine loop of %s ended; restarting it (restart %d)", self.replica_name,
                              self.restarts)
                if self.telemetry is not None:
                    self.telemetry.on_loop_restart()
                await asyncio.sleep(0.01)

    def _fail(self, rid: str, error: BaseException, reason: str = "error") -> None:
        """End one request with ``error``; the engine frees its slot before the next step."""
        live = self.live.pop(rid, None)
        self.delivery.holding.pop(rid, None)
        if live is not None:
            live.queue.put_nowait(error)
            live.last.set()
        self._stage_abort(rid)
        if self.telemetry is not None:
            self.telemetry.on_finish(rid, reason, error=str(error))

    def _params(self, rid: str) -> tuple[str, int, float, SamplingParams] | None:
        """A queued request's sampling parameters (on the loop thread); a malformed one fails here."""
        live = self.live.get(rid)
        if live is None:
            return None
        r = live.req
        d = self.controller.decision
        tau = max(live.tau_lo, min(live.tau_hi, d.tau))
        conf = r.min_confidence if r.min_confidence is not None else d.min_confidence
        try:
            params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed,
                                    max_new_tokens=r.max_new_tokens, stop_token_ids=list(r.stop_token_ids),
                                    stop=list(r.stop), ignore_eos=r.ignore_eos, min_tokens=r.min_tokens, tau=tau,
                                    min_confidence=conf,
                                    exact=r.profile == "exact", presence_penalty=r.presence_penalty,
                                    frequency_penalty=r.frequency_penalty, repetition_penalty=r.repetition_penalty,
                                    logit_bias={int(t): float(b) for t, b in r.logit_bias}, grammar=r.grammar or None,
                                    logprobs=r.logprobs if r.logprobs >= 0 else None)
        except Exception as e:
            self._reject(rid, e)
            return None
        return rid, tau, conf, params

    def _reject(self, rid: str, error: BaseException) -> None:
        """End a request its admission refused: the input's fault (``RequestFailed``) or ours (internal)."""
        live = self.live.get(rid)
        if isinstance(error, (RequestFailed, ReplicaInternalError)):  # already typed (tokenising the prompt)
            self._fail(rid, error)
        elif isinstance(error, RequestError) and live is not None:  # in the names of the request's API
            self._fail(rid, refused(live.req, error))
        elif isinstance(error, (ValueError, TypeError, OverflowError)):  # a field of the wrong type or range
            self._fail(rid, RequestFailed("request", f"request: rejected by the engine "
                                                     f"({type(error).__name__}: {error})"))
        else:
            self._fail(rid, internal_error(rid, "admission failed", error))

    def _admitted(self, rid: str, tau: int, conf: float, error: BaseException | None, t_wall: float,
                  t_perf: float, prompt_tokens: int) -> None:
        """Bookkeeping of one admission, back on the loop thread."""
        live = self.live.get(rid)
        if error is not None:
            self._reject(rid, error)
            return
        if live is None:  # cancelled while it was being added: the next job aborts it
            self._stage_abort(rid)
            return
        r = live.req
        live.prompt_tokens = prompt_tokens
        reached, live.t_admit_wall = live.t_admit_wall, t_wall
        live.t_admit = live.t_last = t_perf
        if self.telemetry is not None:
            self.telemetry.on_admit(rid, live.prompt_tokens, tau, conf,
                                    max(0.0, (live.t_admit_wall - r.arrival_s) * 1e3) if r.arrival_s else 0.0,
                                    max(0.0, (live.t_admit_wall - reached) * 1e3))

    # -- the event loop's side ------------------------------------------------------------------
    def _stage_abort(self, rid: str) -> None:
        """Have the engine thread abort ``rid`` before its next step (an admission still staged is dropped)."""
        with self.worker.lock:
            inbox = self.worker.inbox
            if rid in inbox.requests:
                del inbox.requests[rid]
                inbox.admissions = [a for a in inbox.admissions if a[0] != rid]
            inbox.aborts.append(rid)
            self.worker.kick()

    async def _run(self, ready: asyncio.Event) -> None:
        """Consume the engine thread's finished jobs in order: the admissions' bookkeeping, the step's
        telemetry, its blocks, the controller; the engine thread runs the next step meanwhile."""
        with self.worker.lock:
            self.worker.kick()  # a job loop that stopped for an event loop that was gone goes on
        while True:
            with self.worker.lock:
                result = self.worker.results.popleft() if self.worker.results else None
                if result is not None:
                    self.worker.kick()  # a job loop that stopped for this event loop goes on
            if result is None:
                ready.clear()
                with self.worker.lock:
                    if self.worker.results:  # (queued after the last look, before the clear)
                        continue
                await ready.wait()
                continue
            if isinstance(result, LoopDied):
                raise RuntimeError("the engine thread's job loop ended") from result.error
            job, done = result
            if isinstance(done, Exception):  # an engine bug must not hang every stream
                for rid in list(self.live):
                    self._fail(rid, internal_error(rid, "engine step failed", done))
                with self.worker.lock:
                    self.worker.halted = False  # the live requests' aborts are staged: the next job runs them
                    self.worker.kick()
                continue
            self._consume(job, done)

    def _consume(self, job: Job, done: Done) -> None:
        """What the event loop does with one finished job (the step's time: its job's start to its end, on the
        engine thread)."""
        self._load = (done.num_waiting, done.num_running)
        terms = {a[0]: a for a in job.admissions}
        for rid, error, t_wall, prompt_tokens in done.added:
            _, tau, conf, _ = terms[rid]
            self._admitted(rid, tau, conf, error, t_wall, done.t_start, prompt_tokens)
        if done.outputs is None:
            return
        self.num_steps += 1
        now = done.t_end
        step_ms = (now - done.t_start) * 1e3
        for rid in {o.req_id for o in done.outputs}:
            if (lv := self.live.get(rid)) is not None:
                lv.step_ms += step_ms
                lv.step_cpu_ms += done.cpu_s * 1e3
        if self.telemetry is not None:
            self.delivery.observe_step(done.outputs, now - done.t_start)
        for o in done.outputs:
            try:
                self.delivery.dispatch(o, now, done.seqs.get(o.req_id))
            except Exception as e:
                self._fail(o.req_id, internal_error(o.req_id, "delivering a block failed", e))
        self.delivery.flush()
        self._apply_controller()

    def _apply_controller(self) -> None:
        self.controller.observe_load(self._load[0] + len(self.worker.inbox.admissions), self._load[1])
        self.apply_decision()

    def apply_decision(self) -> None:
        """Give every live request the controller's τ (within its bounds) and, unless pinned, its gate: staged
        for the engine thread's next job (the engine is never touched from the event loop). It replaces a
        decision still staged; it is applied after that job's admissions, so a request admitted with it gets
        it too."""
        if not self.live:
            return
        d = self.controller.decision
        taus = {rid: (max(lv.tau_lo, min(lv.tau_hi, d.tau)), lv.fixed_confidence) for rid, lv in self.live.items()}
        with self.worker.lock:
            self.worker.inbox.taus, self.worker.inbox.min_confidence = taus, d.min_confidence
            self.worker.kick()

    def reconfigure(self, cfg: ControllerConfig) -> None:
        self.controller.reconfigure(cfg)
        for live in self.live.values():
            live.tau_lo, live.tau_hi = self._bounds(live.req)
