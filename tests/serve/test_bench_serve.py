"""``dmtd bench serve`` against the test stack: every policy and concurrency measured, JSON + PNG written."""

from __future__ import annotations

import argparse
import json

from dmtd.bench.serve_bench import add_bench_serve_args, run_bench_serve, summarize


def test_bench_serve_runs_all_policies(stack, tmp_path):
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    out = tmp_path / "serve.json"
    args = p.parse_args(["--server", stack.grpc_target, "--concurrency", "1,2", "--requests-per-worker", "1",
                         "--max-new-tokens", "8", "--rate", "4", "--open-requests", "3", "--json", str(out)])
    result = run_bench_serve(args, "unused")
    rows = json.loads(out.read_text())["rows"]
    assert {(r["policy"], r.get("concurrency")) for r in rows if r["mode"] == "closed"} == {
        (p, n) for p in ("tau1", "tau3", "adaptive") for n in (1, 2)}
    assert {r["policy"] for r in rows if r["mode"] == "open"} == {"tau1", "tau3", "adaptive"}
    for r in rows:
        assert r["tokens"] == 8 * r["requests"] and r["tokens_per_s"] > 0 and 0 <= r["slo_attainment"] <= 1
        assert r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0
    assert result["rows"] == rows and out.with_suffix(".png").stat().st_size > 5000


def test_summary_arithmetic():
    res = [{"ttft_ms": 100.0, "e2e_ms": 400.0, "tokens": 4, "itl_ms": [10.0, 10.0, 10.0]},
           {"ttft_ms": 3000.0, "e2e_ms": 3500.0, "tokens": 4, "itl_ms": [100.0, 100.0, 100.0]}]
    s = summarize(res, wall_s=2.0, ttft_slo=2000.0, itl_slo=50.0)
    assert s["tokens_per_s"] == 4.0 and s["slo_attainment"] == 0.5
    # nearest rank (dmtd_contract.stats.percentile): half of the six ITLs are <= 10 ms
    assert s["itl_p50_ms"] == 10.0 and s["ttft_p95_ms"] == 3000.0


def test_compare_engine_runs_the_same_workload_on_an_in_process_engine(stack, tmp_path):
    """``--compare-engine``: every closed-loop row gains the engine's tokens/s, TTFT and ITL for the same
    workload, and ``stack_efficiency`` is the ratio of the two throughputs."""
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    out = tmp_path / "compare.json"
    args = p.parse_args(["--server", stack.grpc_target, "--compare-engine", "--variant", "none", "--decoding-layers",
                         "8", "--concurrency", "1,2", "--policies", "tau1,adaptive", "--requests-per-worker", "1",
                         "--max-new-tokens", "12", "--repeats", "2", "--json", str(out)])
    run_bench_serve(args, "unused")
    rows = json.loads(out.read_text())["rows"]
    assert {(r["policy"], r["concurrency"]) for r in rows} == {(p, n) for p in ("tau1", "adaptive") for n in (1, 2)}
    for r in rows:
        e = r["engine"]
        # the same requests, every token counted (12 > τ_max: a second block, so ITL, even at the highest τ
        # the controller, which carries its history from run to run as the replica's does, may reach)
        assert e["tokens"] == r["tokens"] == 12 * r["concurrency"]
        assert r["engine_tokens_per_s"] == e["tokens_per_s"] > 0
        assert abs(r["stack_efficiency"] - r["tokens_per_s"] / r["engine_tokens_per_s"]) < 1e-9
        pairs = [a / b for a, b in zip(r["repeats_tokens_per_s"], r["repeats_engine_tokens_per_s"], strict=True)]
        assert r["stack_efficiency_pairs"] == pairs and r["stack_efficiency_paired"] == sum(pairs) / 2  # median of 2
        assert r["engine_ttft_p95_ms"] >= r["engine_ttft_p50_ms"] > 0 and r["engine_itl_p50_ms"] > 0
        assert len(r["repeats_tokens_per_s"]) == 2 and r["tokens_per_s"] == max(r["repeats_tokens_per_s"])
        assert e["cpu_ms_per_token"] > 0
        assert 0 < e["step_cpu_ms_per_token"] <= e["step_ms_per_token"] * 1.001  # the engine thread's CPU ≤ wall


def test_stage_breakdown_comes_from_both_processes_spans(stack):
    """The per-stage table of a closed-loop run: every stage present, the engine's steps inside each
    request's lifetime, tokens as streamed."""
    import uuid

    from dmtd.bench.serve_bench import closed_loop
    from dmtd.bench.serve_stages import MEASURES, STAGES, collect_stages

    tag = f"stages-{uuid.uuid4().hex[:8]}"
    res, _ = closed_loop(stack.grpc_target, "tau1", 2, 2, 6, tag)
    table = collect_stages(stack.app, tag, expected=4)
    assert table["requests"] == 4 and table["tokens"] == sum(r["tokens"] for r in res) == 24
    per_req = table["ms_per_request"]
    assert set(per_req) == set(MEASURES) == set(STAGES) | {"engine_step_cpu"} and all(v >= 0 for v in per_req.values())
    assert 0 < per_req["engine_step"] <= table["e2e_ms_per_request"]
    assert 0 < per_req["engine_step_cpu"] <= per_req["engine_step"]  # the engine thread's CPU in its steps
    assert per_req["ray_hop"] > 0 and per_req["client_write"] > 0
    assert all(abs(table["ms_per_token"][k] - v * 4 / 24) < 1e-6 for k, v in per_req.items())


def test_the_in_process_engine_shows_its_controller_the_load_a_replica_would(smollm2):
    """At N = 1 a closed loop never has a request waiting: the next one reaches a replica a round trip after
    the last finished. The in-process engine must not count it as queued when it tells its controller the
    load (it did, and the controller held the engine at its pressure gate and a raised τ at every request
    boundary, a faster and lower-quality operating point than the replica's)."""
    from dmtd.bench.engine_compare import engine_closed_loop
    from dmtd.bench.serve_bench import PROMPTS
    from dmtd.engine.config import DMTDConfig, EngineConfig
    from dmtd.engine.llm import LLMEngine
    from dmtd.serve.controller import ControllerConfig, Decision, TauController

    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=4, max_model_len=256), default_tau=1)
    # an ITL SLO no step misses on a loaded test machine: only the queue could put the controller under pressure
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=3, rest_min_confidence=0.5, max_batch=4, itl_slo_ms=60e3)
    loads: list[tuple[int, int]] = []

    class Recording(TauController):  # the real controller, remembering every load it was told
        def observe_load(self, queue_depth: int, batch_size: int) -> Decision:
            loads.append((queue_depth, batch_size))
            return super().observe_load(queue_depth, batch_size)

    ctl = Recording(cfg)
    res, _ = engine_closed_loop(engine, cfg, (0, 0, ""), 1, 3, 4, PROMPTS, ctl)
    assert [r["tokens"] for r in res] == [4, 4, 4]
    assert loads and all(q == 0 and running <= 1 for q, running in loads)
    assert ctl.decision.min_confidence == 0.5 and ctl.decision.tau == 3  # the rest point: no pressure seen


def test_the_in_process_engine_runs_the_profile_a_replica_would(smollm2):
    """A request that names no profile runs the variant's default there (the exact profile for the shipped
    variant): the in-process side of ``--compare-engine`` must run it too. It ran the unverified DMTD profile, and
    the stack (exact) read 0.68 of an engine doing other work. The ``dmtd`` and ``exact`` policies name theirs."""
    from dmtd.bench.engine_compare import engine_closed_loop
    from dmtd.bench.serve_bench import POLICIES, PROMPTS
    from dmtd.engine.config import DMTDConfig, EngineConfig
    from dmtd.engine.llm import LLMEngine
    from dmtd.serve.controller import ControllerConfig, TauController

    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=2, max_model_len=256), default_tau=1)
    seen: list[bool] = []
    add = engine.add_request

    def recording(prompt, params, **kw):  # type: ignore[no-untyped-def]
        seen.append(params.exact)
        return add(prompt, params, **kw)

    engine.add_request = recording  # type: ignore[method-assign]
    ran = {}
    for default in ("exact", "dmtd"):
        cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=3, max_batch=2, itl_slo_ms=60e3, default_profile=default)
        for policy in ("adaptive", "exact", "dmtd"):
            seen.clear()
            res, _ = engine_closed_loop(engine, cfg, POLICIES[policy], 2, 1, 3, PROMPTS, TauController(cfg))
            assert [r["tokens"] for r in res] == [3, 3]
            ran[default, policy] = set(seen)
    assert ran == {("exact", "adaptive"): {True}, ("exact", "exact"): {True}, ("exact", "dmtd"): {False},
                   ("dmtd", "adaptive"): {False}, ("dmtd", "exact"): {True}, ("dmtd", "dmtd"): {False}}


def test_static_batches_add_the_next_requests_only_when_the_batch_is_done(smollm2):
    """``--compare-engine``'s static side (arrivals over static batches): the N workers' next requests join only
    once every request of the batch has finished, so no prefill ever meets a running decode; the closed loop adds a
    worker's next request at once. Both run the same requests and tokens."""
    from dmtd.bench.engine_compare import engine_closed_loop
    from dmtd.bench.serve_bench import POLICIES, PROMPTS
    from dmtd.engine.config import DMTDConfig, EngineConfig
    from dmtd.engine.llm import LLMEngine
    from dmtd.serve.controller import ControllerConfig, TauController

    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=2, max_model_len=256), default_tau=1)
    cfg = ControllerConfig(tau_min=1, tau_max=1, rest_tau=1, max_batch=2, itl_slo_ms=60e3)
    add, running_at_add = engine.add_request, []

    def recording(prompt, params, **kw):  # type: ignore[no-untyped-def]
        running_at_add.append(engine.num_running + engine.num_waiting)
        return add(prompt, params, **kw)

    engine.add_request = recording  # type: ignore[method-assign]
    # three workers on two slots: the third worker's first request runs after the first two's
    for static in (True, False):
        running_at_add.clear()
        res, _ = engine_closed_loop(engine, cfg, POLICIES["tau1"], 3, 2, 5, PROMPTS, TauController(cfg),
                                    static=static)
        assert sorted(r["tokens"] for r in res) == [5] * 6
        if static:  # each batch of three added to an idle engine
            assert running_at_add == [0, 1, 2, 0, 1, 2]
        else:  # the first two workers' second requests join while the third's first still runs
            assert running_at_add[:3] == [0, 1, 2] and running_at_add[3] >= 1
