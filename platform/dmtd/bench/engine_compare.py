"""``dmtd bench serve --compare-engine``: the serve bench's closed-loop workload run on an in-process engine.

Same prompts, same max tokens, same variant (built as a replica builds it: ``engine_builder.EngineBuilder``), same τ
policy: fixed bounds pin τ; ``adaptive`` feeds a :class:`TauController` the observations the replica's
engine loop feeds it (every block's interval, the load after every step) and applies its τ and gate. N
workers each send their requests back to back: a worker's next request is added as soon as its previous
one finishes. No Ray, gRPC, asyncio or threads: this is what the serving stack is measured against.

TTFT and ITL are measured as the bench's client measures them, on blocks: TTFT is the time to the first
block (a DMTD cycle's tokens arrive together), ITL a block's interval spread over its k tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.serve.controller import ControllerConfig, TauController


@dataclass
class _Req:
    worker: int
    index: int
    bounds: tuple[int, int]
    t0: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)
    step_ms: float = 0.0  # the steps it ran in: wall time, and this thread's CPU time (as a replica's blocks carry)
    step_cpu_ms: float = 0.0


def _bounds(cfg: ControllerConfig, lo: int, hi: int) -> tuple[int, int]:
    """A request's τ range, as ``EngineLoop._bounds`` computes it for the adaptive profile."""
    a, b = cfg.tau_min, cfg.tau_max
    if lo:
        a = min(max(a, lo), b)
    if hi:
        b = max(min(b, hi), a)
    return a, b


def engine_closed_loop(engine: LLMEngine, cfg: ControllerConfig, policy: tuple[int, int, str], n: int,
                       per_worker: int, max_new: int, prompts: list[str], ctl: TauController | None = None,
                       static: bool = False) -> tuple[list[dict[str, Any]], float]:
    """N workers × ``per_worker`` chat requests of ``max_new`` tokens (``ignore_eos``), prompts as the serve
    bench picks them (worker w's j-th request asks ``prompts[(100 w + j) % len]``), with ``policy``'s τ bounds
    (0: the controller's) and profile ("": the variant's default, resolved as the replica resolves it: a bench that
    sent the stack's requests in the exact profile and the engine's in the unverified one had compared two
    different workloads). Returns per-request records shaped like ``bench.one_request``'s and the run's wall
    time.

    ``ctl``: the controller to drive and feed; pass the same one to every run of a bench, as a replica's one
    controller sees every request it serves (fixed-τ ones too), so that both sides carry the same history.

    ``static``: the same requests as static batches instead of arrivals: the N workers' j-th requests are added
    together once every (j − 1)-th has finished, so no prefill ever joins a running decode. Arrivals over static, at
    the same N, is what interleaving chunked prefill with decode costs (the kernel/step issue's ≥ 0.85)."""
    ctl = ctl if ctl is not None else TauController(cfg)
    lo, hi = _bounds(cfg, *policy[:2])
    exact = cfg.profile_of(policy[2]) == "exact"  # as the replica resolves a request's profile
    live: dict[str, _Req] = {}
    results: list[dict[str, Any]] = []
    waiting: list[tuple[int, int]] = []  # workers' next requests not yet added (static: until the batch is done)

    def submit(w: int, j: int) -> None:
        d = ctl.decision
        tau = max(lo, min(hi, d.tau))
        i = w * 100 + j
        rid = f"w{w}-{j}"
        live[rid] = _Req(w, j, (lo, hi), time.perf_counter())
        engine.add_request(engine.encode([{"role": "user", "content": prompts[i % len(prompts)]}]),
                           SamplingParams(max_new_tokens=max_new, ignore_eos=True, tau=tau, exact=exact,
                                          min_confidence=d.min_confidence), req_id=rid)

    t_start = time.perf_counter()
    for w in range(n):
        submit(w, 0)
    while live:
        successors: list[tuple[int, int]] = []
        t0, c0 = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        now, cpu_ms = time.perf_counter(), (time.thread_time() - c0) * 1e3
        for rid in {o.req_id for o in outputs}:
            if (q := live.get(rid)) is not None:
                q.step_ms += (now - t0) * 1e3
                q.step_cpu_ms += cpu_ms
        for o in outputs:
            r = live.get(o.req_id)
            if r is None or (not o.block and not o.finished):
                continue
            k = len(o.block or [])
            if r.first is None:
                r.first = now
            elif k:
                interval = (now - (r.last or now)) * 1e3
                r.itl_ms.extend([interval / k] * k)
                ctl.observe_block(k, o.tau, interval)
            r.last = now
            r.tokens += k
            if o.finished:
                engine.release(o.req_id)
                del live[o.req_id]
                results.append({"ttft_ms": ((r.first or r.t0) - r.t0) * 1e3, "e2e_ms": ((r.last or r.t0) - r.t0) * 1e3,
                                "tokens": r.tokens, "itl_ms": r.itl_ms, "step_ms": r.step_ms,
                                "step_cpu_ms": r.step_cpu_ms})
                if r.index + 1 < per_worker:
                    successors.append((r.worker, r.index + 1))
        # the load as a replica's controller sees it after a step: a worker's next request is not queued yet
        # (through the stack it arrives a round trip later); counted here, it read as pressure at every
        # request boundary and held the engine at the pressure gate
        ctl.observe_load(engine.num_waiting, engine.num_running)
        d = ctl.decision
        for rid in live:
            engine.retune(rid, max(lo, min(hi, d.tau)), d.min_confidence)
        waiting.extend(successors)
        if not static or not live:
            for w, j in waiting:
                submit(w, j)
            waiting.clear()
    return results, time.perf_counter() - t_start


def build_local_engine(variant: str, model: str | None, decoding_layers: int | None, max_num_seqs: int,
                       itl_slo_ms: float) -> tuple[LLMEngine, ControllerConfig]:
    """The engine and controller settings a replica of this variant builds (``EngineBuilder``), on every
    core of this machine."""
    import os

    from dmtd.serve.engine_builder import EngineBuilder
    from dmtd.serve.settings import EngineSettings

    return EngineBuilder(variant=variant, model=model, decoding_layers=decoding_layers,
                         torch_threads=os.cpu_count() or 1,
                         settings=EngineSettings(max_num_seqs=max_num_seqs, itl_slo_ms=itl_slo_ms))()
