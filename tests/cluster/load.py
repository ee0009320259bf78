"""Client load against the cluster's gateway: gRPC streams that record where they ran and how they ended, and a
closed loop of short requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from dmtd.client import AsyncDMTDClient
from dmtd.v1 import generate_pb2 as pb

TOPICS = ["the sea", "a mountain", "a library", "a train", "a garden", "a storm", "a city at night", "a forest",
          "a bakery", "a lighthouse", "a desert", "a river", "a market", "a castle", "a school", "an island"]


def chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}. (#{i})"}]


# A client of every ingress pod at once, as a gRPC client of a headless gateway Service would be: round_robin over
# the READY connections (a gateway that drains sends GOAWAY and stops listening: its connection leaves the pick
# list), a call refused before its first answer retried on another (gRPC retries a call only while nothing of its
# response has come back), reconnection tried every 0.2-1 s (gRPC's default backoff reaches 120 s).
BALANCED_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{"name": [{}], "retryPolicy": {
        "maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "2s", "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]}}],
}


def balanced(targets: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target and channel options of a client balancing over ``targets`` (``host:port`` each)."""
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", json.dumps(BALANCED_SERVICE_CONFIG)), ("grpc.enable_retries", 1),
        ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000)]
    return f"ipv4:{','.join(targets)}", options


@dataclass
class StreamResult:
    """One request: the replica that served it, its tokens, and how (``OK`` or a gRPC status name) and when it
    ended (``time.monotonic()``)."""

    index: int
    started: float
    replica: str = ""
    tokens: int = 0
    code: str = ""
    detail: str = ""
    first_block: float | None = None
    ended: float = 0.0
    ended_wall: float = 0.0  # time.time(), to set beside a container's death
    expected_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.code == "OK"


async def stream(client: AsyncDMTDClient, i: int, max_new_tokens: int, first: asyncio.Event | None = None,
                 ignore_eos: bool = True) -> StreamResult:
    """A greedy chat stream that runs to ``max_new_tokens`` (EOS ignored, so its length is known)."""
    res = StreamResult(i, time.monotonic(), expected_tokens=max_new_tokens)
    try:
        gen = cast(AsyncGenerator[pb.TokenBlock, None], client.generate(
            messages=chat(i), max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))
        async with contextlib.aclosing(gen) as blocks:
            async for b in blocks:
                if res.first_block is None:
                    res.first_block = time.monotonic()
                    res.replica = b.replica
                    if first is not None:
                        first.set()
                res.tokens += len(b.token_ids)
        res.code = "OK"
    except grpc.aio.AioRpcError as e:
        res.code, res.detail = e.code().name, str(e.details())
    res.ended, res.ended_wall = time.monotonic(), time.time()
    return res


@dataclass
class ClosedLoop:
    """``clients`` clients, each sending its next short request as soon as the last one ends, until stopped."""

    target: str
    clients: int = 4
    max_new_tokens: int = 12
    options: list[tuple[str, Any]] | None = None  # the channel's (balanced's)
    results: list[StreamResult] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _client(self, c: int) -> None:
        async with AsyncDMTDClient(self.target, timeout_s=120, options=self.options) as client:
            n = 0
            while not self._stop.is_set():
                self.results.append(await stream(client, c * 1000 + n, self.max_new_tokens))
                n += 1

    def start(self) -> ClosedLoop:
        self._tasks = [asyncio.create_task(self._client(c)) for c in range(self.clients)]
        return self

    async def stop(self) -> list[StreamResult]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.results


async def first_success(target: str, timeout_s: float, max_new_tokens: int = 4) -> tuple[float, int]:
    """The wall-clock time (``time.time()``) a new short request first completes (retrying failures), and how
    many attempts failed before."""
    t0 = time.monotonic()
    failures = 0
    async with AsyncDMTDClient(target, timeout_s=timeout_s) as client:
        while time.monotonic() - t0 < timeout_s:
            res = await stream(client, 99, max_new_tokens)
            if res.ok and res.tokens == max_new_tokens:
                return res.ended_wall, failures
            failures += 1
            await asyncio.sleep(0.1)
    raise TimeoutError(f"no request succeeded in {timeout_s} s ({failures} failed)")
