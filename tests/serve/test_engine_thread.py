"""The engine thread takes its own jobs (engine_loop): the event loop only stages admissions, aborts and the
controller's decisions. Under load every request gets its tokens, the controller's τ and gate still reach them,
and aborts, bad requests and failed steps leave the engine with no stuck rows and the job loop idle."""

from __future__ import annotations

import asyncio

import pytest

from dmtd.serve.controller import ControllerConfig
from dmtd.serve.errors import ReplicaInternalError, RequestFailed
from dmtd.serve.replica import DMTDReplica
from dmtd_contract.records import Block, ReplicaRequest
from tests.engine.test_exact import prompts_of
from tests.serve import test_exact_replica as exact
from tests.serve.test_replica import collect, make_replica, req


async def settled(rep: DMTDReplica) -> dict:
    """The replica's stats once the engine thread has nothing left to do (or after ~2 s)."""
    loop = rep.loop
    for _ in range(400):
        if (not loop.worker.running and not loop.worker.results and not loop.live
                and loop.engine.scheduler.num_free_kv_rows == loop.engine.cfg.max_num_seqs):
            break
        await asyncio.sleep(0.005)
    return await rep.stats()


def assert_idle(rep: DMTDReplica, stats: dict) -> None:
    engine = rep.loop.engine
    assert stats["active"] == 0 and stats["pending"] == 0 and stats["waiting"] == 0 and stats["running"] == 0
    assert stats["free_kv_rows"] == engine.cfg.max_num_seqs
    assert not engine.has_unfinished() and engine.seqs == {}
    assert not rep.loop.worker.running and not rep.loop.worker.results  # the job loop returned: no thread spins


def test_many_requests_under_load_with_an_abort_and_bad_requests_get_their_tokens_and_leave_nothing():
    """Sixteen exact requests on four rows (twelve queued: the controller raises τ and loosens the gate, then
    brings them back), a stream closed after two blocks, a request torch refuses at admission and one whose
    prompt is too long, all at once: every exact request gets τ = 1's tokens, the bad ones fail alone, and
    afterwards nothing is left in the engine and the engine thread's job loop has returned."""
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=2, rest_min_confidence=0.0, pressure_min_confidence=0.6,
                           itl_slo_ms=1e9, max_batch=4, hold_steps=1)
    rep = exact.make_replica(cfg, max_num_seqs=4, max_queued=16)
    prompts = prompts_of([5, 9, 14, 7, 3, 11, 6, 8, 12, 4, 10, 13, 5, 7, 9, 6], 5)
    n = 24
    ref = exact.tau1(prompts, n)

    async def aborted_after_two() -> int:
        got = 0
        async for _ in rep.generate(exact.req("victim", prompts[0], 200)):
            got += 1
            if got == 2:
                break  # closes the stream mid-request: the engine aborts it
        return got

    async def poison() -> BaseException:
        bad = ReplicaRequest(request_id="poison", prompt_token_ids=[1, 2, 3], temperature=0.7, seed="x")
        with pytest.raises(ReplicaInternalError) as e:  # past validation: torch refuses the seed
            async for _ in rep.loop.submit(bad):
                pass
        return e.value

    async def too_long() -> BaseException:
        with pytest.raises(RequestFailed) as e:
            await exact.collect(rep, exact.req("long", [1] * 300, 5))
        return e.value

    async def scenario() -> tuple[list[list[Block]], int, BaseException, BaseException, dict]:
        streams = [asyncio.create_task(exact.collect(rep, exact.req(f"x{i}", p, n, profile="exact")))
                   for i, p in enumerate(prompts)]
        await asyncio.sleep(0)
        got, err, long_err = await asyncio.gather(aborted_after_two(), poison(), too_long())
        out = list(await asyncio.gather(*streams))
        return out, got, err, long_err, await settled(rep)

    streams, got, err, long_err, stats = asyncio.run(scenario())
    assert [exact.tokens(s) for s in streams] == ref
    assert all(s[-1].finish_reason == "length" and s[-1].usage.completion_tokens == n for s in streams)
    assert all([b.block_index for b in s] == list(range(len(s))) for s in streams)
    taus = {b.tau for s in streams for b in s}
    gates = {b.min_confidence for s in streams for b in s}
    assert len(taus) >= 2 and gates == {0.0, 0.6}, (taus, gates)  # the controller's decisions reached them
    assert got == 2 and "error id" in str(err) and isinstance(long_err, RequestFailed)
    assert long_err.field == "prompt_token_ids"
    assert_idle(rep, stats)
    assert rep.loop.restarts == 0 and stats["steps"] > 0

    after = asyncio.run(exact.collect(rep, exact.req("after", prompts[1], n, profile="exact")))  # a new loop
    assert exact.tokens(after) == ref[1]
    assert_idle(rep, asyncio.run(settled(rep)))


def test_a_step_that_raises_fails_the_live_requests_and_the_engine_thread_goes_on():
    """An engine bug in a step (here injected into one step) fails the requests then live, with an error id;
    their rows are freed, the loop is not restarted, and the next request runs."""
    rep = make_replica(max_num_seqs=4)
    engine = rep.loop.engine
    original, calls = engine.step, {"n": 0}

    def broken_once():  # fault injection on the engine thread, inside the job: after aborts and admissions
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected")
        return original()

    engine.step = broken_once  # type: ignore[method-assign]

    async def failing(rid: str) -> BaseException:
        with pytest.raises(ReplicaInternalError) as e:
            await collect(rep, req(rid, 200, ignore_eos=True))
        return e.value

    async def scenario() -> tuple[list[BaseException], list[Block], dict]:
        errors = list(await asyncio.gather(failing("a"), failing("b")))
        stats = await settled(rep)
        assert_idle(rep, stats)
        return errors, await collect(rep, req("c", 20)), await settled(rep)

    errors, blocks, stats = asyncio.run(scenario())
    assert all("error id" in str(e) and e.error_id for e in errors)
    assert sum(b.k for b in blocks) == 20 and blocks[-1].finish_reason == "length"
    assert_idle(rep, stats)
    assert rep.loop.restarts == 0


def test_a_job_loop_that_ends_with_its_own_error_is_restarted_and_the_request_completes():
    """A bug of the engine thread's job loop itself (outside a job; here injected once) ends the event loop's
    side too: the supervisor counts a restart, submits the job loop again and the request still completes."""
    rep = make_replica()
    inbox = rep.loop.worker.inbox
    original, calls = inbox.take, {"n": 0}

    def broken_once():
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected")
        return original()

    inbox.take = broken_once  # type: ignore[method-assign]

    async def scenario() -> tuple[list[Block], dict]:
        blocks = await collect(rep, req("a", 30))
        return blocks, await settled(rep)

    blocks, stats = asyncio.run(scenario())
    assert calls["n"] > 4
    assert sum(b.k for b in blocks) == 30 and blocks[-1].finish_reason == "length"
    assert rep.loop.restarts == 1 and stats["loop_restarts"] == 1
    assert_idle(rep, stats)
