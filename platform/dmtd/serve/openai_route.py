"""The OpenAI routes' work once a request is validated and admitted: one replica stream per choice (``n``),
merged as their blocks come, turned into a whole response or Server-Sent Events (chunks per choice ``index``),
with ``logprobs`` and ``tool_calls``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi.responses import JSONResponse, StreamingResponse

from dmtd.serve.gateway import GatewayCore, GatewayError
from dmtd.serve.openai_api import (
    chat_logprobs,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    usage_chunk,
)
from dmtd.serve.routing import Route
from dmtd.serve.structured import tool_calls
from dmtd_contract.records import Block, ReplicaRequest


@dataclass
class _Choice:
    """One choice's stream so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    num_chars: int = 0  # text sent so far (completions' text_offset)
    started: bool = False


async def merged(core: GatewayCore, route: Route, reqs: list[ReplicaRequest],
                 traceparent: str | None) -> AsyncIterator[tuple[int, Block]]:
    """(choice index, block) of every request's stream, as they come; the first error ends them all."""
    streams = [core.stream(route, r, traceparent=traceparent) for r in reqs]
    if len(streams) == 1:
        try:
            async for b in streams[0]:
                yield 0, b
        finally:
            close = getattr(streams[0], "aclose", None)
            if close is not None:
                await close()  # at once, not when collected: it cancels the replica's work
        return
    queue: asyncio.Queue[tuple[int, Block | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Block]) -> None:
        try:
            async for b in stream:
                queue.put_nowait((i, b))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(choices: list[_Choice]) -> dict[str, int]:
    """The request's usage: the prompt once, the choices' completions and drafts summed."""
    out = {k: choices[0].usage.get(k, 0) if choices else 0 for k in ("prompt_tokens", "cached_tokens")}
    for key in ("completion_tokens", "drafted_tokens", "accepted_tokens"):
        out[key] = sum(c.usage.get(key, 0) for c in choices)
    return out


class OpenAIResponder:
    """Answers one validated request: ``body`` (the OpenAI model), ``reqs`` (one per choice)."""

    def __init__(self, core: GatewayCore, route: Route, body: Any, reqs: list[ReplicaRequest], chat: bool,
                 rid: str, error: Callable[[GatewayError], JSONResponse]) -> None:
        self.core, self.route, self.body, self.reqs, self.chat, self.rid = core, route, body, reqs, chat, rid
        self.error = error
        self.choices = [_Choice() for _ in reqs]
        self.want_logprobs = reqs[0].logprobs >= 0
        # a reply that may be a tool call is held back until it is whole (then it goes as tool_calls or as text)
        self.hold = chat and bool(getattr(body, "tools", None)) and body.tool_choice != "none"

    async def respond(self, traceparent: str | None) -> Any:
        if len(self.reqs) > 1 and self.core.inflight + len(self.reqs) > self.core.max_inflight:
            return self.error(GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"gateway at capacity for n={len(self.reqs)} streams; retry later", 250))
        blocks = aiter(merged(self.core, self.route, self.reqs, traceparent))
        if self.body.stream:
            try:  # the first block before the headers: a refusal is a real status code, not an event after 200
                first: tuple[int, Block] | None = await anext(blocks)
            except GatewayError as e:
                return self.error(e)
            except StopAsyncIteration:
                first = None
            return StreamingResponse(self._sse(blocks, first), media_type="text/event-stream")
        try:
            async for i, b in blocks:
                self._take(i, b)
        except GatewayError as e:
            return self.error(e)
        out = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            calls = tool_calls(self.body, text) if self.hold else None
            out.append(completion_choice(self.chat, i, text, c.finish, self._logprobs(c, c.logprobs, 0), calls))
        return completion_response(self.rid, self.route.name, self.chat, out, _usage(self.choices))

    def _take(self, i: int, b: Block) -> _Choice:
        c = self.choices[i]
        c.text.append(b.text)
        c.logprobs.extend(b.logprobs)
        if b.finish_reason:
            c.finish = b.finish_reason
        if b.usage is not None:
            c.usage = b.usage.as_dict()
        return c

    def _logprobs(self, c: _Choice, entries: list[Any], offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    async def _sse(self, blocks: AsyncIterator[tuple[int, Block]],
                   head: tuple[int, Block] | None) -> AsyncIterator[str]:
        async def chained() -> AsyncIterator[tuple[int, Block]]:
            if head is not None:
                yield head
            async for item in blocks:
                yield item

        rid, model, chat = self.rid, self.route.name, self.chat
        try:
            async for i, b in chained():
                c = self._take(i, b)
                if self.hold:
                    if b.finish_reason:
                        yield self._held(i, c)
                    continue
                if b.text or b.finish_reason or not c.started or b.logprobs:
                    yield completion_chunk(rid, model, chat, b.text, b.finish_reason, not c.started, i,
                                           self._logprobs(c, b.logprobs, c.num_chars))
                    c.started = True
                    c.num_chars += len(b.text)
        except GatewayError as e:  # a failure after the first block (e.g. the replica went away)
            yield f"data: {json.dumps(error_body(str(e), e.code.name.lower()))}\n\n"
        finally:
            with contextlib.suppress(Exception):
                await blocks.aclose()  # type: ignore[attr-defined]
        body = self.body
        if body.stream_options and body.stream_options.include_usage and all(c.usage for c in self.choices):
            yield usage_chunk(rid, model, chat, _usage(self.choices))
        yield "data: [DONE]\n\n"

    def _held(self, i: int, c: _Choice) -> str:
        """A held-back reply, whole: its tool calls, or its text."""
        text = "".join(c.text)
        calls = tool_calls(self.body, text)
        lp = self._logprobs(c, c.logprobs, 0)
        if calls:
            return completion_chunk(self.rid, self.route.name, True, "", "tool_calls", True, i, lp, calls)
        return completion_chunk(self.rid, self.route.name, True, text, c.finish, True, i, lp)
