"""The replica's engine loop without Ray: blocks, cancellation, backpressure, the controller."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from dmtd.engine.config import DMTDConfig
from dmtd.engine.sequence import TEMPERATURE_FLOOR, SamplingParams
from dmtd.serve.controller import ControllerConfig, TauController
from dmtd.serve.errors import ReplicaInternalError
from dmtd.serve.replica import DMTDReplica, Overloaded, RequestFailed
from dmtd_contract.records import Block, ReplicaRequest
from tests.conftest import tiny_engine, tiny_model

DMTD = DMTDConfig(0, 4, 2, tau_max=4)


def make_replica(max_num_seqs: int = 4, max_queued: int = 2, rest_tau: int = 3,
                 stream_interval_ms: float = 0.0, max_model_len: int = 256) -> DMTDReplica:
    model = tiny_model(seed=21)
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=rest_tau, max_batch=max_num_seqs, hold_steps=10**9)
    return DMTDReplica(lambda: (tiny_engine(model, DMTD, max_num_seqs=max_num_seqs, max_model_len=max_model_len), cfg),
                       max_queued=max_queued,
                       name="r0", stream_interval_ms=stream_interval_ms)


def req(rid: str, n: int = 20, **kw) -> ReplicaRequest:
    return ReplicaRequest(**{"request_id": rid, "prompt_token_ids": [1, 2, 3, 4, 5], "max_new_tokens": n, **kw})


async def collect(rep: DMTDReplica, r: ReplicaRequest) -> list[Block]:
    return [b async for b in rep.generate(r)]


def test_blocks_carry_the_engines_tokens():
    rep = make_replica()
    # the replica's telemetry reaches the block delivery that counts each step (set after the loop is built)
    assert rep.loop.delivery.telemetry is rep.telemetry is rep.loop.telemetry
    blocks = asyncio.run(collect(rep, req("a", 20)))
    solo = tiny_engine(tiny_model(seed=21), DMTD).generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=20,
                                                                                             tau=3))[0]
    assert [t for b in blocks for t in b.token_ids] == solo.token_ids
    assert [b.k for b in blocks] == [len(x) for x in solo.blocks] and all(b.tau == 3 for b in blocks)
    assert [b.block_index for b in blocks] == list(range(len(blocks)))
    last = blocks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 20
    assert last.usage.blocks == len(blocks) and last.usage.prompt_tokens == 5


def test_concurrent_streams_and_cancel_frees_slot():
    rep = make_replica(max_num_seqs=4)

    async def scenario():
        streams = [asyncio.create_task(collect(rep, req(f"r{i}", 16))) for i in range(3)]

        async def cancel_after_two():
            got = 0
            async for _ in rep.generate(req("victim", 200)):
                got += 1
                if got == 2:
                    break
            return got

        got = await cancel_after_two()
        results = await asyncio.gather(*streams)
        for _ in range(50):
            if (await rep.stats())["active"] == 0 and rep.loop.engine.scheduler.num_free_kv_rows == 4:
                break
            await asyncio.sleep(0.01)
        return got, results, await rep.stats()

    got, results, stats = asyncio.run(scenario())
    assert got == 2
    assert all(sum(b.k for b in r) == 16 for r in results)
    assert stats["active"] == 0 and stats["free_kv_rows"] == 4


def test_overload_and_bad_requests():
    rep = make_replica(max_num_seqs=1, max_queued=1)

    async def scenario():
        first = rep.generate(req("a", 50))
        await first.__anext__()
        second = asyncio.create_task(collect(rep, req("b", 5)))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as e:
            await collect(rep, req("c", 5))
        assert e.value.retry_after_ms > 0
        await first.aclose()  # frees a place
        with pytest.raises(RequestFailed) as bad:
            await collect(rep, req("d", 5, prompt_token_ids=[1] * 300))
        assert bad.value.field == "prompt_token_ids" and "context" in str(bad.value)
        return await second

    assert sum(b.k for b in asyncio.run(scenario())) == 5


def test_controller_raises_tau_under_pressure_and_returns_at_headroom():
    c = TauController(ControllerConfig(tau_min=1, tau_max=4, rest_tau=2, itl_slo_ms=50, max_batch=8, hold_steps=1))
    assert c.decision.tau == 2
    for _ in range(3):
        d = c.observe_load(queue_depth=5, batch_size=8)
    assert d.tau == 4 and "queued" in d.reason
    for _ in range(100):
        c.observe_block(3, 3, 30.0)  # 10 ms per token: far below the SLO
    for _ in range(5):
        d = c.observe_load(queue_depth=0, batch_size=1)
    assert d.tau == 2 and "headroom" in d.reason
    for _ in range(300):
        c.observe_block(1, 4, 60.0)  # blocks cut to 1 of 4: raising τ would not help
    d = c.observe_load(queue_depth=3, batch_size=8)
    assert d.tau == 2 and "full" in d.reason


def _timed(rep: DMTDReplica, r: ReplicaRequest, times: list[float]):
    async def run() -> list[Block]:
        out = []
        async for b in rep.generate(r):
            times.append(time.perf_counter())
            out.append(b)
        return out
    return run()


def test_a_poison_request_fails_alone_and_the_stream_in_flight_keeps_its_pace():
    """Past all validation (straight into the loop): torch's own error ends that request only."""
    rep = make_replica(max_num_seqs=4)
    times: list[float] = []

    async def scenario():
        stream = asyncio.create_task(_timed(rep, req("steady", 120, temperature=0.0), times))
        while len(times) < 10:
            await asyncio.sleep(0.001)
        normal = statistics.median(b - a for a, b in zip(times, times[1:]))
        t_poison = time.perf_counter()
        poison = ReplicaRequest(request_id="poison", prompt_token_ids=[1, 2, 3], temperature=0.7,
                                seed="x")
        with pytest.raises(ReplicaInternalError) as e:
            async for _ in rep.loop.submit(poison):
                pass
        n_before = len(times)
        while len(times) < n_before + 5:
            await asyncio.sleep(0.001)
        blocks = await stream
        return normal, t_poison, e.value, blocks

    normal, t_poison, err, blocks = asyncio.run(scenario())
    assert "error id" in str(err) and err.error_id
    after = [t for t in times if t >= t_poison]
    gaps = [b - a for a, b in zip([t_poison, *after], after)]
    assert max(gaps[:6]) < max(0.5, 10 * normal), (normal, gaps[:6])
    assert sum(b.k for b in blocks) == 120 and blocks[-1].finish_reason == "length"
    assert rep.loop.restarts == 0 and rep.loop.engine.scheduler.num_free_kv_rows == 4


def test_bad_types_past_the_gateway_are_named_by_the_replica_in_the_requests_api():
    rep = make_replica()
    grpc = [({"seed": "x"}, "sampling.seed"), ({"temperature": "0.5"}, "sampling.temperature"),
            ({"stop": [None]}, "stop[0]"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
            ({"prompt_token_ids": ["a"]}, "prompt_token_ids[0]"), ({"prompt_token_ids": [1] * 300}, "prompt_token_ids"),
            ({"logprobs": 50}, "logprobs")]
    completions = [({"seed": "x"}, "seed"), ({"temperature": "0.5"}, "temperature"),
                   ({"max_new_tokens": 0}, "max_tokens"), ({"prompt_token_ids": [1] * 300}, "prompt"),
                   ({"prompt_token_ids": [999_999]}, "prompt"),
                   ({"logprobs": 50}, "logprobs"), ({"request_id": "x" * 200}, "user_request_id")]
    chat = [({"temperature": 11.0}, "temperature"), ({"logprobs": 50}, "top_logprobs"),
            ({}, "messages"),  # this engine has no chat template
            ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role")]
    cases = [*[(bad, "grpc", f) for bad, f in grpc], *[(bad, "openai-completions", f) for bad, f in completions],
             *[({"prompt_token_ids": None, "messages": [{"role": "user", "content": "hi"}], **bad}, "openai-chat", f)
               for bad, f in chat]]
    for bad, api, field in cases:
        with pytest.raises(RequestFailed) as e:
            asyncio.run(collect(rep, req("b", field_names=api, **bad)))
        assert e.value.field == field and str(e.value).startswith(field + ": "), (bad, api, str(e.value))
    with pytest.raises(RequestFailed) as e:  # not a ReplicaRequest at all (a dict, as before the records)
        asyncio.run(collect(rep, {"request_id": "b", "prompt_token_ids": [1]}))
    assert e.value.field == "request" and "dict" in str(e.value)


def test_the_supervisor_restarts_a_loop_that_ended_and_counts_it():
    rep = make_replica()
    original = rep.loop._apply_controller
    calls = {"n": 0}

    def broken_once() -> None:  # fault injection: the loop itself raises once, between steps
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        original()

    rep.loop._apply_controller = broken_once  # type: ignore[method-assign]
    blocks = asyncio.run(collect(rep, req("a", 30)))
    assert sum(b.k for b in blocks) == 30 and blocks[-1].finish_reason == "length"
    assert rep.loop.restarts == 1 and rep.loop.stats()["loop_restarts"] == 1


def test_temperatures_below_the_floor_are_greedy():
    assert SamplingParams(temperature=1e-37).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=TEMPERATURE_FLOOR).greedy
    engine = tiny_engine(tiny_model(seed=21), DMTD)
    greedy = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, tau=2))[0].token_ids
    tiny = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, tau=2, temperature=1e-37,
                                                       seed=3))[0].token_ids
    assert tiny == greedy


def test_the_engine_is_built_and_run_on_one_thread_only():
    """OpenMP gives every thread that opens a parallel region a pool of its own; with two pools on two cores
    libgomp stops spinning between regions and a decode step took twice as long (engine_loop's docstring).
    So the engine's construction, admissions, tokenisation and steps all run on the engine's one thread,
    never on the event loop's or the constructor's."""
    import threading

    seen: dict[str, set[int]] = {}
    model = tiny_model(seed=21)
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=2, max_batch=4, hold_steps=10**9)

    def factory():
        seen.setdefault("build", set()).add(threading.get_ident())
        eng = tiny_engine(model, DMTD, max_num_seqs=4)
        def recorded(name: str):
            orig = getattr(eng, name)

            def wrapped(*a, **k):
                seen.setdefault(name, set()).add(threading.get_ident())
                return orig(*a, **k)
            return wrapped

        for name in ("add_request", "step", "encode"):
            setattr(eng, name, recorded(name))
        return eng, cfg

    rep = DMTDReplica(factory, max_queued=2, name="r0")

    async def scenario() -> tuple[int, list[list[Block]]]:
        out = await asyncio.gather(collect(rep, req("a", 12)), collect(rep, req("b", 9, tau_max=1)),
                                   collect(rep, req("c", 5, prompt_token_ids=[7, 8, 9])))
        return threading.get_ident(), list(out)

    loop_thread, streams = asyncio.run(scenario())
    assert [sum(b.k for b in s) for s in streams] == [12, 9, 5]
    assert set(seen) == {"build", "add_request", "step", "encode"}
    engine_threads = set().union(*seen.values())
    assert len(engine_threads) == 1, seen
    assert loop_thread not in engine_threads and threading.main_thread().ident not in engine_threads


def test_streamed_items_gather_the_blocks_of_an_interval_and_the_last_block_goes_at_once():
    """What the gateway streams (``generate_batches``): the first block alone, then one list per interval;
    the request's last block does not wait for the interval to end (here 1 s: the request takes ~0.05 s)."""
    rep = make_replica(stream_interval_ms=1000)
    one_by_one = asyncio.run(collect(rep, req("a", 40, ignore_eos=True)))

    async def batches() -> list[list[Block]]:
        return [b async for b in rep.generate_batches(req("b", 40, ignore_eos=True))]

    t0 = time.perf_counter()
    got = asyncio.run(batches())
    assert time.perf_counter() - t0 < 0.95
    flat = [b for batch in got for b in batch]
    assert [b.token_ids for b in flat] == [b.token_ids for b in one_by_one]
    assert [b.block_index for b in flat] == list(range(len(flat)))
    assert len(got) == 2 and len(got[0]) == 1 and len(got[1]) == len(flat) - 1 > 1
    assert flat[-1].finish_reason == "length" and all(not b.finish_reason for b in flat[:-1])
    assert len({b.sent_s for b in got[1]}) == 1 and all(b.dispatch_ms >= 0 for b in flat)
    # every block carries its steps' wall time and the engine thread's CPU time in them (never more)
    assert all(0 < b.step_cpu_ms <= b.step_ms for b in flat)
    with pytest.raises(ValueError, match="stream_interval_ms"):
        make_replica(stream_interval_ms=1001)


def test_cancelling_a_stream_that_waits_out_its_interval_frees_the_slot():
    rep = make_replica(max_num_seqs=2, stream_interval_ms=1000, max_model_len=8192)

    async def scenario() -> dict:
        gen = rep.generate_batches(req("long", 4000, ignore_eos=True))
        first = await gen.__anext__()
        waiting = asyncio.create_task(gen.__anext__())  # holds for the interval
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await gen.aclose()
        for _ in range(200):  # the loop frees the slot before its next step
            if rep.loop.engine.scheduler.num_free_kv_rows == 2:
                break
            await asyncio.sleep(0.005)
        return {"first": first, **(await rep.stats())}

    out = asyncio.run(scenario())
    assert len(out["first"]) == 1 and out["active"] == 0 and out["free_kv_rows"] == 2


def test_stats_count_the_batch_gates_windows():
    """Exact requests that share steps open the batch gate's windows (dmtd.engine.draft_gate); the replica's stats
    count them by reason, as the engine counts them."""
    from dmtd.engine.config import EngineConfig
    from dmtd.engine.llm import LLMEngine

    model = tiny_model(seed=21)
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=4, max_batch=4, hold_steps=10**9)
    rep = DMTDReplica(lambda: (LLMEngine(model, None, DMTD, EngineConfig(max_num_seqs=4, max_model_len=256,
                                                                         adaptive_drafts=True, draft_quant="none"),
                                         default_tau=1, eos_token_ids=[]), cfg), max_queued=2, name="r0")

    async def scenario():
        await asyncio.gather(*(collect(rep, req(f"x{i}", 40, profile="exact")) for i in range(3)))
        return await rep.stats()

    stats = asyncio.run(scenario())
    windows = stats["gate_windows"]
    assert windows == rep.loop.engine.cycles.draft_gate.decisions
    assert sum(windows.values()) > 0 and windows.get("measure plain", 0) >= 1
