"""The block channel: replicas push a request's blocks straight to the gateway over one TCP connection per
(replica, gateway), instead of streaming them back as items of the Serve call.

Why: a streamed Ray item costs ~2.5 ms of CPU in the replica and ~3.4 ms in the gateway, nearly all of it in
Ray's C++ and gRPC threads (docs/benchmarks.md, "The stack against the engine"); on a CPU node those cores
are the engine's. A frame here costs a ``send`` and a ``recv``. The Serve call stays: it routes the request,
carries its errors (typed, pickled, mapped at the gateway as before), propagates cancellation (closing the
call frees the slot at once) and reports a replica's death (``UNAVAILABLE``).

Wire format: frames of a 4-byte big-endian length and a msgpack body ``[token, [block, ...]]`` (one request's
blocks), each block a map of ``Block`` fields. The replica's engine loop writes the frames of every pushed
request of one engine step in one ``send`` (at N = 16 and τ = 1, one write per step instead of sixteen).
``token`` is the request's secret, issued by the gateway's :class:`BlockSink` for this request only; frames for a
token the sink does not hold are dropped, so a peer that can reach the port but never saw a request cannot inject
into its stream. No pickle crosses this socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
import time
from dataclasses import fields
from typing import Any

import msgpack

from dmtd_contract.records import Block, Usage

log = logging.getLogger("dmtd.push")
MAX_FRAME_BYTES = 16 << 20
_HEADER = struct.Struct(">I")
_BLOCK_FIELDS = tuple(f.name for f in fields(Block))


class PushUnavailable(ConnectionError):
    """The replica cannot reach the gateway's sink; it streams the request's blocks through Serve instead."""


def _block_maps(blocks: list[Block]) -> list[dict[str, Any]]:
    out = []
    for b in blocks:
        d = {name: getattr(b, name) for name in _BLOCK_FIELDS}
        if b.usage is not None:
            d["usage"] = b.usage.as_dict()
        out.append(d)
    return out


def encode_frame(token: str, blocks: list[Block]) -> bytes:
    """One frame: the request's token and its blocks (a ``Usage`` as a map, the confidence triple as a list)."""
    body = msgpack.packb([token, _block_maps(blocks)], use_bin_type=True)
    return _HEADER.pack(len(body)) + body




def decode_blocks(raw: list[dict[str, Any]]) -> list[Block]:
    """Blocks from a frame's list; fields this side does not know (a newer replica) are ignored."""
    out = []
    for d in raw:
        usage = d.pop("usage", None)
        b = Block(**{k: v for k, v in d.items() if k in _BLOCK_FIELDS})
        b.confidence = tuple(b.confidence)  # type: ignore[assignment]
        b.usage = Usage(**usage) if usage else None
        out.append(b)
    return out


class _SinkProtocol(asyncio.Protocol):
    """One replica's connection to the sink: frames parsed as bytes arrive, blocks handed to their request."""

    def __init__(self, sink: BlockSink) -> None:
        self.sink = sink
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 4:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > MAX_FRAME_BYTES:
                log.warning("block sink: a %d-byte frame is over the limit; closing the connection", n)
                self.buf.clear()
                if self.transport is not None:
                    self.transport.close()
                return
            if len(self.buf) < 4 + n:
                return
            body = bytes(self.buf[4: 4 + n])
            del self.buf[: 4 + n]
            self.sink.deliver(body)


class BlockSink:
    """The gateway's end: a TCP server on ``host`` (port chosen by the OS) and one queue per pushed request.

    ``open()`` issues a token and the queue its blocks land in (a list of ``Block`` per frame); ``close(token)``
    forgets it. Runs on the gateway's event loop, so queues are filled without any thread hop."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._server: asyncio.Server | None = None
        self.num_frames = 0
        self.num_dropped = 0

    async def start(self) -> BlockSink:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _SinkProtocol(self), self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def open(self) -> tuple[str, asyncio.Queue[Any]]:
        token = secrets.token_hex(16)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[token] = queue
        return token, queue

    def close(self, token: str) -> None:
        self._queues.pop(token, None)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def deliver(self, body: bytes) -> None:
        try:
            token, raw = msgpack.unpackb(body, raw=False)
            queue = self._queues.get(token) if isinstance(token, str) else None
            if queue is None:
                self.num_dropped += 1  # a request that ended (cancelled) or a token never issued
                return
            queue.put_nowait(decode_blocks(raw))
            self.num_frames += 1
        except Exception:
            self.num_dropped += 1
            log.warning("block sink: dropped a malformed frame", exc_info=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


class _PushProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class BlockPusher:
    """The replica's end: one connection per sink address, opened on first use and reopened after a loss."""

    def __init__(self, connect_timeout_s: float = 2.0, retry_after_s: float = 5.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s  # an address that could not be reached is not tried again sooner
        self._failed: dict[str, tuple[float, str]] = {}  # address → (when, why)
        self._conns: dict[str, tuple[asyncio.Transport, _PushProtocol]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def connected(self, address: str) -> asyncio.Transport | None:
        """The open connection to ``address``, if there is one (no I/O)."""
        conn = self._conns.get(address)
        return conn[0] if conn is not None and not conn[1].lost and not conn[0].is_closing() else None

    async def connect(self, address: str) -> asyncio.Transport:
        """The connection to ``address``, opened if needed; :class:`PushUnavailable` when it cannot be (at once
        while the last attempt's failure is under ``retry_after_s`` old: requests do not queue on a dead sink)."""
        failed = self._failed.get(address)
        if failed is not None and time.monotonic() - failed[0] < self.retry_after_s:
            raise PushUnavailable(failed[1])
        conn = self._conns.get(address)
        if conn is not None and not conn[1].lost and not conn[0].is_closing():
            return conn[0]
        async with self._locks.setdefault(address, asyncio.Lock()):
            conn = self._conns.get(address)
            if conn is not None and not conn[1].lost and not conn[0].is_closing():
                return conn[0]
            host, _, port = address.rpartition(":")
            try:
                transport, protocol = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                    _PushProtocol, host.strip("[]"), int(port)), self.connect_timeout_s)
            except (OSError, ValueError, TimeoutError) as e:
                why = f"block sink {address}: {type(e).__name__}: {e}"
                self._failed[address] = (time.monotonic(), why)
                raise PushUnavailable(why) from e
            self._failed.pop(address, None)
            self._conns[address] = (transport, protocol)
            return transport

    async def push(self, address: str, token: str, blocks: list[Block]) -> None:
        """Send one frame; :class:`PushUnavailable` when the sink cannot be reached (nothing was sent)."""
        transport = await self.connect(address)
        transport.write(encode_frame(token, blocks))

    def write_groups(self, address: str, groups: list[tuple[str, list[Block]]]) -> dict[int, Exception] | None:
        """Send several requests' frames in one write on an open connection. None (nothing sent) when there is
        none; else the groups whose blocks could not be encoded (index → error): the others were sent."""
        transport = self.connected(address)
        if transport is None:
            return None
        frames, failed = [], {}
        for i, (token, blocks) in enumerate(groups):
            try:
                frames.append(encode_frame(token, blocks))
            except Exception as e:  # one request's bad field must not hold back the others' blocks
                failed[i] = e
        if frames:
            transport.write(b"".join(frames))
        return failed

    def close(self) -> None:
        for transport, _ in self._conns.values():
            transport.close()
        self._conns.clear()
