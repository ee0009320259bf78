"""The block channel (dmtd.serve.push) without Ray: a real replica pushes to a real sink over loopback TCP, and
the gateway's core merges the pushed frames with the call's own stream (errors, end, fallback)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from typing import Any

import grpc
import msgpack
import pytest

from dmtd.serve import push as push_module
from dmtd.serve.gateway import GatewayCore, GatewayError
from dmtd.serve.push import BlockPusher, BlockSink, PushUnavailable, decode_blocks, encode_frame
from dmtd.serve.replica import DMTDReplica
from dmtd.serve.routing import Route, Router
from dmtd_contract.records import Block, ReplicaRequest, Usage
from tests.serve.test_replica import collect, make_replica, req


class _Call:
    """What a Serve handle's streaming call looks like to the gateway: an async iterator with ``cancel()``."""

    def __init__(self, agen: Any) -> None:
        self.agen, self.cancelled = agen, False
        self.pending: asyncio.Future[Any] | None = None

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        self.pending = asyncio.ensure_future(self.agen.__anext__())
        return await self.pending

    def cancel(self) -> None:  # as Serve does: the replica's generator is cancelled where it waits
        self.cancelled = True
        if self.pending is not None:
            self.pending.cancel()


class LocalHandle:
    """The replica's methods behind the handle API the gateway calls (``options(stream=True).m.remote``)."""

    def __init__(self, replica: DMTDReplica, drop_block: int | None = None) -> None:
        self.replica, self.drop_block = replica, drop_block
        self.calls: list[_Call] = []

    def options(self, **_: Any) -> LocalHandle:
        return self

    @property
    def generate_batches(self) -> LocalHandle:
        return self

    def remote(self, request: ReplicaRequest) -> _Call:
        call = _Call(self._batches(request))
        self.calls.append(call)
        return call

    async def _batches(self, request: ReplicaRequest) -> Any:
        pusher = self.replica.pusher
        real = pusher.write_groups
        token = request.push_token

        def lossy(address: str, groups: list[tuple[str, list[Block]]]) -> Any:  # a block lost on the way
            kept = [(t, [b for b in blocks if t != token or b.block_index != self.drop_block]) for t, blocks in groups]
            return real(address, [(t, blocks) for t, blocks in kept if blocks])

        if self.drop_block is not None:
            pusher.write_groups = lossy  # type: ignore[method-assign]
        try:
            async with contextlib.aclosing(self.replica.generate_batches(request)) as items:
                async for item in items:
                    yield item
        finally:
            pusher.write_groups = real  # type: ignore[method-assign]


def test_a_frame_carries_blocks_and_their_usage_both_ways():
    blocks = [Block("r", [5, 6], "ab", 0, 2, 3, 0.5, (0.4, 0.6, 0.9), 12.5),
              Block("r", [7], "c", 1, 1, 3, finish_reason="length", usage=Usage(4, 3, 2, 1, 0, 0, 0), step_ms=3.0)]
    frame = encode_frame("tok", blocks)
    (n,) = struct.unpack(">I", frame[:4])
    token, raw = msgpack.unpackb(frame[4:], raw=False)
    assert n == len(frame) - 4 and token == "tok"
    assert decode_blocks(raw) == blocks
    raw[0]["a_field_from_a_newer_replica"] = 1
    assert decode_blocks(raw)[0] == blocks[0]


def _core(replica: DMTDReplica, sink: BlockSink | None, **handle_kw: Any) -> tuple[GatewayCore, LocalHandle]:
    handle = LocalHandle(replica, **handle_kw)
    own = replica.variants.set.own  # the route's name is the variant the replica serves
    return GatewayCore(Router({own: Route(own, handle)}, own), 8, sink=sink, push_grace_s=2.0), handle


def _watch_items(handle: LocalHandle) -> list[Any]:
    """What travels through the Serve call itself (items), recorded as the gateway receives them."""
    items: list[Any] = []
    real = handle._batches

    async def watched(request: ReplicaRequest) -> Any:
        async for item in real(request):
            items.append(item)
            yield item

    handle._batches = watched  # type: ignore[method-assign]
    return items


async def _pushing_setup(tokens: int) -> tuple[DMTDReplica, list[Block], BlockSink, GatewayCore, list[Any]]:
    """A replica, its blocks for one request streamed directly, a running sink, a core pushing through it, and
    the list of what travels through the Serve call."""
    rep = make_replica()
    direct = await collect(rep, req("direct", tokens))
    sink = await BlockSink("127.0.0.1").start()
    core, handle = _core(rep, sink)
    return rep, direct, sink, core, _watch_items(handle)


async def _through(core: GatewayCore, r: ReplicaRequest) -> list[Block]:
    return [b async for b in core.stream(core.admit(core.router.default), r)]


def test_pushed_blocks_equal_the_streamed_ones_and_nothing_travels_through_the_call():
    async def scenario():
        rep, direct, sink, core, items = await _pushing_setup(24)
        pushed = await asyncio.gather(*(_through(core, req(f"p{i}", 24)) for i in range(3)))
        await asyncio.sleep(0.05)
        await sink.stop()
        return direct, pushed, items, sink, core

    direct, pushed, items, sink, core = asyncio.run(scenario())
    for blocks in pushed:
        assert [t for b in blocks for t in b.token_ids] == [t for b in direct for t in b.token_ids]
        assert [b.block_index for b in blocks] == list(range(len(blocks)))
        assert blocks[-1].finish_reason == "length" and blocks[-1].usage.completion_tokens == 24
    assert items == []  # every block came over the socket
    assert sink.num_frames == sum(len(b) for b in pushed) and sink.num_open == 0 and sink.num_dropped == 0
    assert core.completed == 3 and core.inflight == 0


def test_a_replica_that_cannot_reach_the_sink_streams_through_the_call():
    async def scenario():
        rep = make_replica()
        sink = BlockSink("127.0.0.1")
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            sink.port = s.getsockname()[1]
        core, _ = _core(rep, sink)
        return await _through(core, req("fallback", 20)), await collect(rep, req("direct", 20))

    pushed, direct = asyncio.run(scenario())
    assert [t for b in pushed for t in b.token_ids] == [t for b in direct for t in b.token_ids]
    assert pushed[-1].finish_reason == "length"


def test_errors_cancellation_and_lost_frames_on_the_pushed_path():
    async def scenario():
        rep = make_replica(max_num_seqs=2)
        sink = await BlockSink("127.0.0.1").start()
        core, handle = _core(rep, sink)
        out: dict[str, Any] = {}
        with pytest.raises(GatewayError) as bad:
            await _through(core, req("bad", 20, top_p=7.0))
        out["bad"] = bad.value
        got = 0
        stream = core.stream(core.admit(core.router.default), req("victim", 200))
        async for _ in stream:  # the client goes away after two blocks
            got += 1
            if got == 2:
                break
        await stream.aclose()
        for _ in range(100):
            if rep.loop.num_active == 0 and rep.loop.engine.scheduler.num_free_kv_rows == 2:
                break
            await asyncio.sleep(0.01)
        out["victim"] = got, rep.loop.num_active, rep.loop.engine.scheduler.num_free_kv_rows, handle.calls[-1].cancelled
        lossy, _ = _core(rep, sink, drop_block=2)
        with pytest.raises(GatewayError) as lost:
            await _through(lossy, req("lossy", 20))
        out["lost"] = lost.value
        out["after"] = await _through(core, req("after", 12))
        out["open"] = sink.num_open
        await sink.stop()
        return out

    out = asyncio.run(scenario())
    assert out["bad"].code == grpc.StatusCode.INVALID_ARGUMENT and out["bad"].field == "sampling.top_p"
    assert out["victim"] == (2, 0, 2, True)
    assert out["lost"].code == grpc.StatusCode.INTERNAL and "block 2 of the stream was lost" in str(out["lost"])
    assert sum(b.k for b in out["after"]) == 12 and out["open"] == 0


def test_the_sink_drops_strangers_and_malformed_frames_and_keeps_serving():
    async def scenario():
        sink = await BlockSink("127.0.0.1").start()
        token, queue = sink.open()
        _, w = await asyncio.open_connection("127.0.0.1", sink.port)
        w.write(encode_frame("not-a-token", [Block("x", [1], k=1)]))
        body = b"\x93not msgpack at all"
        w.write(struct.pack(">I", len(body)) + body)
        w.write(encode_frame(token, [Block("r", [9], k=1)]))
        await w.drain()
        got = await asyncio.wait_for(queue.get(), 5)
        _, big = await asyncio.open_connection("127.0.0.1", sink.port)  # a frame over the limit: that peer only
        big.write(struct.pack(">I", 1 << 30))
        await big.drain()
        await asyncio.sleep(0.05)
        w.write(encode_frame(token, [Block("r", [10], block_index=1, k=1)]))
        await w.drain()
        again = await asyncio.wait_for(queue.get(), 5)
        w.close()
        big.close()
        await sink.stop()
        return got, again, sink.num_dropped

    got, again, dropped = asyncio.run(scenario())
    assert [b.token_ids for b in got] == [[9]] and [b.token_ids for b in again] == [[10]]
    assert dropped == 2


def test_a_step_of_several_pushed_requests_goes_out_in_one_write():
    async def scenario():
        rep = make_replica()
        sink = await BlockSink("127.0.0.1").start()
        core, _ = _core(rep, sink)
        writes: list[list[str]] = []
        real = rep.pusher.write_groups

        def counted(address: str, groups: list[tuple[str, list[Block]]]) -> Any:
            writes.append([t for t, _ in groups])
            return real(address, groups)

        rep.pusher.write_groups = counted  # type: ignore[method-assign]
        pushed = await asyncio.gather(*(_through(core, req(f"g{i}", 16)) for i in range(3)))
        await sink.stop()
        return pushed, writes, sink

    pushed, writes, sink = asyncio.run(scenario())
    blocks = sum(len(b) for b in pushed)
    assert all(sum(b.k for b in p) == 16 and p[-1].finish_reason == "length" for p in pushed)
    assert max(len(w) for w in writes) == 3  # the three requests' frames of a step went in one write
    assert len(writes) < blocks and sink.num_frames == blocks and sink.num_dropped == 0


def test_a_sink_lost_mid_stream_sends_the_rest_through_the_call():
    async def scenario():
        rep, direct, sink, core, items = await _pushing_setup(20)
        real_write = rep.pusher.write_groups
        calls = 0

        def gone_after_two(address: str, groups: list[tuple[str, list[Block]]]) -> Any:
            nonlocal calls
            calls += 1
            return real_write(address, groups) if calls <= 2 else None  # None: no connection

        rep.pusher.write_groups = gone_after_two  # type: ignore[method-assign]
        got = await _through(core, req("moved", 20))
        await sink.stop()
        return direct, got, items

    direct, got, items = asyncio.run(scenario())
    assert [t for b in got for t in b.token_ids] == [t for b in direct for t in b.token_ids]
    assert [b.block_index for b in got] == list(range(len(got))) and got[-1].finish_reason == "length"
    assert items and items[0][0].block_index == 2  # blocks 0 and 1 were pushed, the rest came through the call


def test_a_block_that_cannot_be_encoded_fails_its_request_alone():
    async def scenario():
        rep = make_replica(max_num_seqs=3)
        sink = await BlockSink("127.0.0.1").start()
        core, _ = _core(rep, sink)
        real = push_module.encode_frame

        def encode(token: str, blocks: list[Block]) -> bytes:  # request e1's third block has a field msgpack refuses
            if any(b.request_id == "e1" and b.block_index >= 2 for b in blocks):
                raise TypeError("can not serialize 'object' object")
            return real(token, blocks)

        push_module.encode_frame = encode  # type: ignore[assignment]
        try:
            out = await asyncio.gather(*(_through(core, req(f"e{i}", 16)) for i in range(3)), return_exceptions=True)
        finally:
            push_module.encode_frame = real  # type: ignore[assignment]
        for _ in range(100):
            if rep.loop.num_active == 0 and rep.loop.engine.scheduler.num_free_kv_rows == 3:
                break
            await asyncio.sleep(0.01)
        state = rep.loop.num_active, rep.loop.engine.scheduler.num_free_kv_rows, sink.num_open
        await sink.stop()
        return out, state

    out, state = asyncio.run(scenario())
    failed = [o for o in out if isinstance(o, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], GatewayError) and failed[0].code == grpc.StatusCode.INTERNAL
    assert "encoding a block failed" in str(failed[0])
    assert all(sum(b.k for b in o) == 16 for o in out if not isinstance(o, BaseException))
    assert state == (0, 3, 0)  # no slot, live request or sink entry left behind


def test_a_sink_that_cannot_be_reached_is_not_retried_at_once():
    async def scenario():
        with socket.socket() as s:  # a port nobody listens on, yet
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"127.0.0.1:{port}"
        pusher = BlockPusher(retry_after_s=30.0)
        errors = []
        with pytest.raises(PushUnavailable) as first:
            await pusher.connect(address)
        errors.append(str(first.value))
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port)
        with pytest.raises(PushUnavailable) as second:  # listening now, but the failure is fresh: not tried
            await pusher.connect(address)
        errors.append(str(second.value))
        pusher.retry_after_s = 0.0
        connected = await pusher.connect(address) is pusher.connected(address)
        pusher.close()
        server.close()
        return errors, connected

    errors, connected = asyncio.run(scenario())
    assert errors[0] == errors[1] and "ConnectionRefusedError" in errors[0] and connected


def _timed_writes(rep: DMTDReplica) -> list[tuple[float, list[int]]]:
    """Each frame the replica writes, as (when, its blocks' indices)."""
    frames: list[tuple[float, list[int]]] = []
    real = rep.pusher.write_groups

    def timed(address: str, groups: list[tuple[str, list[Block]]]) -> Any:
        frames.extend((time.perf_counter(), [b.block_index for b in blocks]) for _, blocks in groups)
        return real(address, groups)

    rep.pusher.write_groups = timed  # type: ignore[method-assign]
    return frames


async def _through_slowed(interval_ms: float, rid: str, n: int, delay: Any
                         ) -> tuple[list[Block], list[tuple[float, list[int]]], list[float]]:
    """One pushed request through the core, on a replica with ``stream_interval_ms`` whose engine sleeps
    ``delay(k)`` seconds before its k-th step: its blocks, the frames written, and when each step began."""
    rep = make_replica(stream_interval_ms=interval_ms)
    real_step = rep.loop.engine.step
    starts: list[float] = []

    def slowed() -> Any:
        starts.append(time.perf_counter())
        time.sleep(delay(len(starts)))
        return real_step()

    rep.loop.engine.step = slowed  # type: ignore[method-assign]
    sink = await BlockSink("127.0.0.1").start()
    core, _ = _core(rep, sink)
    frames = _timed_writes(rep)
    got = await _through(core, req(rid, n))
    await sink.stop()
    return got, frames, starts


def test_pushed_blocks_go_out_once_per_stream_interval_and_the_client_gets_one_block_a_frame():
    """With a stream interval, a pushed request's first block is written at once and the rest at most once per
    interval (every step's blocks in between in one frame; the last at once); the gateway sends each frame as
    one block: the same tokens, text and usage as the replica's per-cycle stream, in fewer messages."""
    interval_ms = 60.0

    async def scenario():
        direct = await collect(make_replica(), req("direct", 40))  # generate(): one block per cycle, no interval
        # steps of ~8 ms: several fall in an interval, as decode steps do on a CPU
        got, frames, _ = await _through_slowed(interval_ms, "held", 40, lambda _: 0.008)
        return direct, got, frames

    direct, got, frames = asyncio.run(scenario())
    assert [t for b in got for t in b.token_ids] == [t for b in direct for t in b.token_ids]
    assert "".join(b.text for b in got) == "".join(b.text for b in direct)
    assert got[-1].finish_reason == "length" and got[-1].usage.completion_tokens == 40
    assert got[-1].usage.blocks == len(direct)  # the usage counts the engine's blocks, not the messages
    assert len(got) == len(frames) < len(direct)  # one message a frame, fewer than the cycles
    assert frames[0][1] == [0] and [i for _, idx in frames for i in idx] == list(range(len(direct)))
    gaps = [(b[0] - a[0]) * 1e3 for a, b in zip(frames, frames[1:-1], strict=False)]
    assert gaps and min(gaps) >= interval_ms * 0.95  # (the last frame goes as soon as its block is ready)
    assert max(len(idx) for _, idx in frames) > 1


def test_held_blocks_go_out_when_the_steps_stall():
    """A block held for the interval is written by a timer when the next step is late (a long prompt's pass),
    at most an interval after it was due, not when that step ends."""
    interval_ms = 80.0
    # the 7th step takes 0.8 s, with block 1 (τ = 3: steps 4 to 6) held
    got, frames, starts = asyncio.run(_through_slowed(interval_ms, "stalled", 16, lambda k: 0.8 if k == 7 else 0.0))
    t0, t1 = starts[6], starts[6] + 0.8
    assert sum(b.k for b in got) == 16 and got[-1].finish_reason == "length"
    # (the frames written as the slow step began are the step before's, which the event loop consumes then)
    during = [t for t, idx in frames if t0 + 0.05 < t < t1]
    assert during and during[0] - frames[0][0] <= 2 * interval_ms / 1e3 + 0.1  # the timer's frame, not the step's
