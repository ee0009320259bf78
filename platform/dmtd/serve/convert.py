"""Replica block dicts → ``dmtd.v1`` protobuf messages, and block re-chunking for the client stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from dmtd.v1 import generate_pb2 as pb

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_CANCELLED,
          "error": pb.FINISH_REASON_ERROR}


def merge_blocks(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One block from several consecutive ones (re-chunking keeps tokens, text and confidence extremes)."""
    if len(blocks) == 1:
        return blocks[0]
    first, last = blocks[0], blocks[-1]
    tokens = [t for b in blocks for t in b["token_ids"]]
    n = sum(max(b["k"], 1) for b in blocks)
    out = dict(last)
    out.update(token_ids=tokens, text="".join(b["text"] for b in blocks), k=len(tokens),
               block_index=first["block_index"], queue_ms=first.get("queue_ms", 0.0),
               block_ms=sum(b.get("block_ms", 0.0) for b in blocks),
               confidence=(min(b["confidence"][0] for b in blocks),
                           sum(b["confidence"][1] * max(b["k"], 1) for b in blocks) / n,
                           max(b["confidence"][2] for b in blocks)))
    return out


async def rechunk(blocks: AsyncIterator[dict[str, Any]], min_tokens: int, flush_ms: int) -> AsyncIterator[dict]:
    """Hold blocks until ``min_tokens`` tokens are ready or ``flush_ms`` passed; pass through when 0."""
    if min_tokens <= 0:
        async for b in blocks:
            yield b
        return
    held: list[dict[str, Any]] = []
    since = time.perf_counter()
    it = blocks.__aiter__()
    nxt: asyncio.Future[dict[str, Any]] | None = None
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
            if b.get("finish_reason") or sum(len(x["token_ids"]) for x in held) >= min_tokens:
                yield merge_blocks(held)
                held = []
        if held:
            yield merge_blocks(held)
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


def to_token_block(b: dict[str, Any], variant: str, ttft_ms: float | None) -> pb.TokenBlock:
    lo, mean, hi = b["confidence"]
    msg = pb.TokenBlock(
        request_id=b["request_id"], token_ids=b["token_ids"], text=b["text"], block_index=b["block_index"],
        k=b["k"], tau=b["tau"], min_confidence=b.get("min_confidence") or 0.0,
        confidence=pb.ConfidenceSummary(min=lo, mean=mean, max=hi),
        timings=pb.Timings(ttft_ms=ttft_ms or 0.0, block_ms=b.get("block_ms", 0.0), queue_ms=b.get("queue_ms", 0.0)),
        variant=variant, replica=b.get("replica", ""),
    )
    if b.get("finish_reason"):
        msg.finish_reason = FINISH.get(b["finish_reason"], pb.FINISH_REASON_ERROR)
        u = b.get("usage") or {}
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.get("prompt_tokens", 0),
                                    completion_tokens=u.get("completion_tokens", 0), blocks=u.get("blocks", 0),
                                    heads=u.get("heads", 0), cycles_cut=u.get("cycles_cut", 0)))
    return msg


def to_variant_info(info: dict[str, Any]) -> pb.VariantInfo:
    keys = {f.name for f in pb.VariantInfo.DESCRIPTOR.fields}
    return pb.VariantInfo(**{k: v for k, v in info.items() if k in keys and v is not None})
