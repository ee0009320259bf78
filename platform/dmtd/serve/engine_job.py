"""One job on a replica's engine thread (which takes them back to back from what ``engine_loop.EngineLoop``
stages): the aborts, the admissions (each prompt tokenised right before it is added), the controller's τ and gate
for the live requests, one step, and what dispatching the step's blocks needs of each sequence, read before
finished ones are released. Only this code touches the engine; the event loop sees the records below, and
keeps a ``Live`` record of each request it serves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dmtd.engine.llm import LLMEngine
from dmtd.engine.outputs import StepOutput
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.serve.errors import ReplicaInternalError
from dmtd.serve.requests import refused
from dmtd_contract.records import Block, ReplicaRequest, TokenLogprob

log = logging.getLogger("dmtd.replica")


class Pushed:
    """Queued after a pushed request's last frame is written: its call ends."""


PUSHED = Pushed()


@dataclass
class Live:
    """A request the event loop serves: its blocks' queue (or sink) and the bookkeeping of its stream."""
    req: ReplicaRequest
    queue: asyncio.Queue[Block | BaseException | Pushed]
    tau_lo: int
    tau_hi: int
    fixed_confidence: bool
    text: list[str] = field(default_factory=list)
    block_index: int = 0
    num_tokens: int = 0
    num_heads: int = 0
    prompt_tokens: int = 0
    t_admit: float = 0.0
    t_admit_wall: float = 0.0
    t_last: float = 0.0
    cycles_cut: int = 0
    step_ms: float = 0.0  # engine steps this request ran in since its last block
    step_cpu_ms: float = 0.0  # the engine thread's CPU time in those steps
    ready: deque[float] = field(default_factory=deque)  # when each queued block's step ended (perf_counter)
    last: asyncio.Event = field(default_factory=asyncio.Event)  # the last block (or an error) is queued
    push: tuple[str, str] | None = None  # (sink address, token): blocks go to the gateway's sink (dmtd.serve.push)
    interval_s: float = 0.0  # a pushed request's stream interval: its blocks go out at most once per interval
    held: list[tuple[float, Block]] = field(default_factory=list)  # pushed blocks not written yet: (ready at, block)
    t_sent: float = 0.0  # when its last frame was written (perf_counter)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens since the last block


@dataclass
class SeqInfo:
    """What dispatching a step's output needs of its sequence, read on the engine's thread after the step."""
    min_confidence: float
    cycles_cut: int
    drafted: int
    accepted: int
    exact: bool
    cached: int = 0  # prompt tokens from the prefix cache


@dataclass
class EngineCall:
    """Work on the engine between two steps (a variant loaded or let go): ``fn(engine)``, its result or error set on
    ``future`` (which the event loop awaits)."""
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


@dataclass
class Job:
    """One engine-thread job: engine calls, aborts, the controller's τ and gate for the live requests, admissions,
    a step."""
    aborts: list[str]
    admissions: list[tuple[str, int, float, SamplingParams]]
    requests: dict[str, ReplicaRequest]  # of the admissions
    taus: dict[str, tuple[int, bool]]  # live request → its τ, and whether its gate is pinned
    min_confidence: float
    calls: list[EngineCall] = field(default_factory=list)


@dataclass
class Done:
    """A job's result, handed back to the event loop."""
    added: list[tuple[str, BaseException | None, float, int]]  # request, its error, wall time, prompt tokens
    outputs: list[StepOutput] | None  # None: no step ran
    cpu_s: float
    seqs: dict[str, SeqInfo]
    num_waiting: int
    num_running: int
    unfinished: bool
    t_start: float = 0.0  # when the job started and ended on the engine thread (perf_counter)
    t_end: float = 0.0


def run_job(engine: LLMEngine, job: Job, encode: Callable[[ReplicaRequest], list[int]]) -> Done:
    """On the engine's thread: aborts, admissions (each prompt tokenised right before it is added), the
    controller's τ and gate (after the admissions: a request admitted in this job with parameters staged before
    the decision gets it too; unknown and finished requests are left alone), then one step if any request is
    unfinished; what dispatching the step's outputs needs of their sequences is read here, and finished
    sequences are released, so the event loop never touches the engine. An exception of the step itself
    propagates."""
    t_start = time.perf_counter()
    e = engine
    for rid in job.aborts:
        e.abort(rid)
        e.release(rid)
    for call in job.calls:  # before the admissions: a variant loaded here serves a request admitted with it
        try:
            call.future.set_result(call.fn(e))
        except Exception as err:
            call.future.set_exception(err)
    added: list[tuple[str, BaseException | None, float, int]] = []
    for rid, _tau, _conf, params in job.admissions:
        try:
            req = job.requests[rid]
            e.add_request(encode(req), params, req_id=rid, prefill_with=req.prefill_with or None, variant=req.variant)
            added.append((rid, None, time.time(), e.seqs[rid].prompt_len))
        except Exception as err:
            added.append((rid, err, time.time(), 0))
    for rid, (tau, pinned) in job.taus.items():
        e.retune(rid, tau, None if pinned else job.min_confidence)
    outputs, cpu_s, info = None, 0.0, {}
    if e.has_unfinished():
        cpu0 = time.thread_time()
        outputs = e.step()
        cpu_s = time.thread_time() - cpu0
        for o in outputs:
            seq = e.seqs.get(o.req_id)
            if seq is not None and (o.block or o.finished):
                info[o.req_id] = SeqInfo(seq.params.min_confidence, seq.counts.num_cycles_cut, seq.draft.num_drafted,
                                          seq.draft.num_accepted, seq.params.exact, seq.num_cached_tokens)
        for o in outputs:
            if o.finished:
                e.release(o.req_id)
    return Done(added, outputs, cpu_s, info, e.num_waiting, e.num_running, e.has_unfinished(), t_start,
                time.perf_counter())



def encode_prompt(engine: LLMEngine, req: ReplicaRequest) -> list[int]:
    """The prompt's token ids, on the engine's thread in the same job as the request's admission: a job of
    its own queued behind the running step, so the request missed the next step too (one step more of
    TTFT, and its cache row idle for that step, under load). A refusal names the input as the request's API does."""
    prompt: Any = req.messages or req.prompt_token_ids or req.prompt
    try:
        return engine.encode(prompt)
    except RequestError as e:
        raise refused(req, e) from e
    except Exception as e:
        raise internal_error(req.request_id, "tokenising the prompt failed", e) from e


def internal_error(rid: str, what: str, e: BaseException) -> ReplicaInternalError:
    """Our fault, not the request's: logged with an error id the client sees."""
    err = ReplicaInternalError(f"{what} ({type(e).__name__})")
    log.error("request %s: %s [error id %s]", rid, what, err.error_id, exc_info=e)
    return err
