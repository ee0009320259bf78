"""Replica ``Block`` records → ``dmtd.v1`` protobuf messages, and block re-chunking for the client stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from dmtd.v1 import generate_pb2 as pb
from dmtd_contract.records import Block, Usage

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_CANCELLED,
          "error": pb.FINISH_REASON_ERROR}


def merge_blocks(blocks: list[Block]) -> Block:
    """One block from several consecutive ones (re-chunking keeps tokens, text and confidence extremes)."""
    if len(blocks) == 1:
        return blocks[0]
    first, last = blocks[0], blocks[-1]
    tokens = [t for b in blocks for t in b.token_ids]
    n = sum(max(b.k, 1) for b in blocks)
    return replace(last, token_ids=tokens, text="".join(b.text for b in blocks), k=len(tokens),
                   block_index=first.block_index, queue_ms=first.queue_ms, block_ms=sum(b.block_ms for b in blocks),
                   num_drafted=sum(b.num_drafted for b in blocks), num_accepted=sum(b.num_accepted for b in blocks),
                   logprobs=[e for b in blocks for e in b.logprobs],
                   confidence=(min(b.confidence[0] for b in blocks),
                               sum(b.confidence[1] * max(b.k, 1) for b in blocks) / n,
                               max(b.confidence[2] for b in blocks)))


async def rechunk(blocks: AsyncIterator[Block], min_tokens: int, flush_ms: int) -> AsyncIterator[Block]:
    """Hold blocks until ``min_tokens`` tokens are ready or ``flush_ms`` passed; pass through when 0."""
    if min_tokens <= 0:
        async for b in blocks:
            yield b
        return
    held: list[Block] = []
    since = time.perf_counter()
    it = blocks.__aiter__()
    nxt: asyncio.Future[Block] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            timeout = None
            if held and flush_ms > 0:
                timeout = max(0.0, flush_ms / 1e3 - (time.perf_counter() - since))
            done, _ = await asyncio.wait({nxt}, timeout=timeout)
            if not done:
                yield merge_blocks(held)
                held, since = [], time.perf_counter()
                continue
            try:
                b = nxt.result()
            except StopAsyncIteration:
                break
            nxt = None
            if not held:
                since = time.perf_counter()
            held.append(b)
            if b.finish_reason or sum(len(x.token_ids) for x in held) >= min_tokens:
                yield merge_blocks(held)
                held = []
        if held:
            yield merge_blocks(held)
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


def to_token_block(b: Block, variant: str, ttft_ms: float | None) -> pb.TokenBlock:
    lo, mean, hi = b.confidence
    msg = pb.TokenBlock(
        request_id=b.request_id, token_ids=b.token_ids, text=b.text, block_index=b.block_index,
        k=b.k, tau=b.tau, min_confidence=b.min_confidence or 0.0,
        confidence=pb.ConfidenceSummary(min=lo, mean=mean, max=hi),
        timings=pb.Timings(ttft_ms=ttft_ms or 0.0, block_ms=b.block_ms, queue_ms=b.queue_ms),
        variant=variant, replica=b.replica, num_drafted=b.num_drafted, num_accepted=b.num_accepted,
        verifier=b.verifier,
        logprobs=[pb.TokenLogprob(token_id=e[0], token=bytes(e[1]), logprob=e[2],
                                  top=[pb.TopLogprob(token_id=t[0], token=bytes(t[1]), logprob=t[2]) for t in e[3]])
                  for e in b.logprobs],
    )
    if b.finish_reason:
        msg.finish_reason = FINISH.get(b.finish_reason, pb.FINISH_REASON_ERROR)
        u = b.usage or Usage()
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                    blocks=u.blocks, heads=u.heads, cycles_cut=u.cycles_cut,
                                    drafted_tokens=u.drafted_tokens, accepted_tokens=u.accepted_tokens,
                                    cached_tokens=u.cached_tokens))
    return msg


def to_variant_info(info: dict[str, Any]) -> pb.VariantInfo:
    keys = {f.name for f in pb.VariantInfo.DESCRIPTOR.fields}
    return pb.VariantInfo(**{k: v for k, v in info.items() if k in keys and v is not None})
