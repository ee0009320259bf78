"""Delivering a step's blocks (``BlockDelivery``, owned by a replica's ``engine_loop.EngineLoop``): each
request's step output becomes a ``Block`` (its text, timings, usage when it finishes) that goes to the request's
queue, or, for a request pushed to the gateway's block sink, is held until its stream interval has passed and
then written with the step's other due frames to each sink in one write. Runs on the event loop, never on the
engine's thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dmtd.engine.llm import LLMEngine
from dmtd.engine.outputs import StepOutput
from dmtd.serve.controller import TauController
from dmtd.serve.engine_job import PUSHED, Live, SeqInfo, internal_error
from dmtd.serve.push import BlockPusher
from dmtd.telemetry.replica import ReplicaTelemetry
from dmtd_contract.records import Block, Usage

log = logging.getLogger("dmtd.replica")


class BlockDelivery:
    """The loop's block dispatch, given the loop's live requests (``live``, shared) and how it fails one (``fail``)."""

    def __init__(self, *, engine: LLMEngine, controller: TauController, replica_name: str,
                 telemetry: ReplicaTelemetry | None, live: dict[str, Live],
                 fail: Callable[[str, BaseException], None]) -> None:
        self.engine, self.controller, self.replica_name = engine, controller, replica_name
        self.telemetry = telemetry
        self.live = live
        self._fail = fail
        self.pusher: BlockPusher | None = None  # the replica's, for requests submitted with a sink
        self.holding: dict[str, Live] = {}  # pushed requests with blocks not written yet, by request id
        self._flush_timer: asyncio.TimerHandle | None = None  # writes held blocks when steps stall

    def observe_step(self, outputs: list[StepOutput], wall_s: float) -> None:
        assert self.telemetry is not None
        prefill = any(o.req_id in self.live and self.live[o.req_id].num_tokens == 0 for o in outputs)
        self.telemetry.on_step("prefill" if prefill else "decode", wall_s, [(o.req_id, o.tau) for o in outputs])
        heads = sum(1 for o in outputs if o.token_id >= 0 and o.is_head)
        self.telemetry.on_tokens(heads, sum(1 for o in outputs if o.token_id >= 0) - heads)

    def dispatch(self, o: StepOutput, now: float, seq: SeqInfo | None) -> None:
        live = self.live.get(o.req_id)
        if live is None:
            return
        live.text.append(o.text_delta)
        if o.logprob is not None:
            live.logprobs.append(o.logprob)
        if o.token_id >= 0:
            live.num_tokens += 1
            live.num_heads += o.is_head
        if not o.block and not o.finished:
            return
        tokens = list(o.block or [])
        confs = list(o.block_confidences or []) or [0.0]
        interval_ms = (now - live.t_last) * 1e3
        if live.block_index > 0 and tokens:
            self.controller.observe_block(len(tokens), o.tau, interval_ms)
        block = Block(
            request_id=o.req_id, token_ids=tokens, text="".join(live.text), block_index=live.block_index,
            k=len(tokens), tau=o.tau, min_confidence=seq.min_confidence if seq is not None else 0.0,
            confidence=(min(confs), sum(confs) / len(confs), max(confs)),
            block_ms=interval_ms, replica=self.replica_name,
            queue_ms=max(0.0, (live.t_admit_wall - live.req.arrival_s) * 1e3) if live.block_index == 0 else 0.0,
            num_drafted=o.num_drafted, num_accepted=o.num_accepted, step_ms=live.step_ms,
            step_cpu_ms=live.step_cpu_ms, logprobs=live.logprobs,
        )
        live.text, live.t_last, live.step_ms, live.step_cpu_ms, live.logprobs = [], now, 0.0, 0.0, []
        live.block_index += 1
        if self.telemetry is not None:
            cut = seq is not None and seq.cycles_cut > live.cycles_cut
            live.cycles_cut = seq.cycles_cut if seq is not None else live.cycles_cut
            self.telemetry.on_block(o.req_id, len(tokens), o.tau, block.block_index, cut, min(confs),
                                    interval_ms)
            self.telemetry.on_checked(o.num_drafted, o.num_accepted)
        if o.finished:
            block.finish_reason = o.finish_reason or "stop"
            block.error = o.error
            block.usage = Usage(prompt_tokens=live.prompt_tokens, completion_tokens=live.num_tokens,
                                blocks=live.block_index, heads=live.num_heads,
                                cycles_cut=seq.cycles_cut if seq else 0,
                                drafted_tokens=seq.drafted if seq else 0,
                                accepted_tokens=seq.accepted if seq else 0,
                                cached_tokens=seq.cached if seq else 0)
            if seq is not None and seq.exact:
                block.verifier = self.engine.verifier_name
            self.live.pop(o.req_id, None)  # the engine's thread released it after the step
            if self.telemetry is not None:
                self.telemetry.on_finish(o.req_id, block.finish_reason, block.usage.as_dict(), o.error)
        if live.push is not None:
            live.held.append((now, block))
            self.holding[o.req_id] = live
        else:
            live.ready.append(now)
            live.queue.put_nowait(block)
        if o.finished:
            live.last.set()

    def flush(self) -> None:
        """Write the pushed blocks that are due, every due request's frame to a sink in one write: a request's
        first block and its last at once, the others once its stream interval has passed since its last frame
        (checked after every step; the blocks of the steps in between go together, as the streamed path's
        lists do). A timer writes held blocks when the steps stall (a long prompt's pass), at most an interval
        late. A request whose sink connection is gone (or whose write failed) streams its blocks through its
        call from here on; one whose blocks cannot be encoded fails alone."""
        if self._flush_timer is not None:  # (a step's flush comes first: the timer's is not needed now)
            self._flush_timer.cancel()
            self._flush_timer = None
        now, sent = time.perf_counter(), time.time()
        outbox: dict[str, list[tuple[Live, list[Block]]]] = {}
        wake: float | None = None
        for rid, live in list(self.holding.items()):
            held = live.held
            if not held or live.push is None:
                del self.holding[rid]
                continue
            if held[0][1].block_index == 0 or held[-1][1].finish_reason or now - live.t_sent >= live.interval_s:
                blocks = []
                for ready, block in held:
                    block.dispatch_ms, block.sent_s = (now - ready) * 1e3, sent
                    blocks.append(block)
                outbox.setdefault(live.push[0], []).append((live, blocks))
                live.held, live.t_sent = [], now
                del self.holding[rid]
            else:
                due = live.t_sent + 2 * live.interval_s
                wake = due if wake is None else min(wake, due)
        if wake is not None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(max(0.0, wake - now), self.flush)
        for address, groups in outbox.items():
            try:
                failed = None if self.pusher is None else self.pusher.write_groups(
                    address, [(lv.push[1], blocks) for lv, blocks in groups])  # type: ignore[index]
            except Exception:
                log.warning("replica %s: writing to block sink %s failed", self.replica_name, address, exc_info=True)
                failed = None
            for i, (live, blocks) in enumerate(groups):
                if failed is not None and i in failed:
                    self._end_pushed(live, internal_error(live.req.request_id, "encoding a block failed", failed[i]))
                elif failed is not None:
                    if blocks[-1].finish_reason:
                        live.queue.put_nowait(PUSHED)
                else:
                    log.warning("replica %s: block sink %s is gone; streaming request %s through Serve",
                                self.replica_name, address, live.req.request_id)
                    live.push = None
                    for block in blocks:
                        live.ready.append(now - block.dispatch_ms / 1e3)  # when it was ready
                        live.queue.put_nowait(block)

    def _end_pushed(self, live: Live, error: BaseException) -> None:
        """End a pushed request with ``error``, finished (already out of ``live``) or not."""
        rid = live.req.request_id
        if self.live.get(rid) is live:
            self._fail(rid, error)
        else:
            live.queue.put_nowait(error)
            live.last.set()
