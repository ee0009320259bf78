"""The exact profile in the replica, without Ray: the variant's default profile, the τ/k controller, metrics."""

from __future__ import annotations

import asyncio

from dmtd.engine.sequence import SamplingParams
from dmtd.serve.controller import ControllerConfig
from dmtd.serve.replica import DMTDReplica
from dmtd_contract.records import Block, ReplicaRequest
from tests.conftest import tiny_engine
from tests.engine.test_exact import DMTD, base_model, prompts_of

PROMPTS = prompts_of([5, 9, 14, 7], 3)


def make_replica(cfg: ControllerConfig, max_num_seqs: int = 4, max_queued: int = 4) -> DMTDReplica:
    model = base_model(11, 0.05)  # thinking layers near identity: tails often match, acceptance is high
    return DMTDReplica(lambda: (tiny_engine(model, DMTD, max_num_seqs=max_num_seqs), cfg), max_queued=max_queued,
                       name="r-exact")


def tau1(prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = tiny_engine(base_model(11, 0.05), DMTD)
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=n, tau=1))]


def req(rid: str, prompt: list[int], n: int, **kw: object) -> ReplicaRequest:
    return ReplicaRequest(request_id=rid, prompt_token_ids=prompt, max_new_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def collect(rep: DMTDReplica, r: ReplicaRequest) -> list[Block]:
    return [b async for b in rep.generate(r)]


def tokens(blocks: list[Block]) -> list[int]:
    return [t for b in blocks for t in b.token_ids]


def test_a_request_naming_no_profile_gets_the_variants_default_profile():
    rep = make_replica(ControllerConfig(tau_min=1, tau_max=4, rest_tau=3, hold_steps=10**9, default_profile="exact"))
    ref = tau1(PROMPTS[:1], 24)[0]

    default = asyncio.run(collect(rep, req("d", PROMPTS[0], 24)))
    assert tokens(default) == ref and default[-1].verifier == rep.loop.engine.verifier_name != ""
    assert default[-1].usage.drafted_tokens > 0 and all(b.tau == 3 for b in default)
    adaptive = asyncio.run(collect(rep, req("a", PROMPTS[0], 24, profile="adaptive")))  # named: not verified
    assert adaptive[-1].verifier == "" and adaptive[-1].usage.drafted_tokens == 0
    assert asyncio.run(rep.stats())["default_profile"] == "exact"

    rep.reconfigure({"default_profile": "dmtd"})  # as the registry's _on_registry does
    after = asyncio.run(collect(rep, req("d2", PROMPTS[0], 24)))
    assert after[-1].verifier == "" and after[-1].usage.drafted_tokens == 0
    assert asyncio.run(rep.stats())["default_profile"] == "dmtd"


def test_exact_requests_under_the_controller_change_tau_and_gate_never_tokens():
    """Pressure (a queue) raises τ and loosens the gate, headroom brings them back, mid-request: the exact
    requests' drafting follows, their tokens stay τ = 1's."""
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=2, rest_min_confidence=0.0, pressure_min_confidence=0.6,
                           itl_slo_ms=1e9, max_batch=2, hold_steps=1)
    rep = make_replica(cfg, max_num_seqs=2, max_queued=4)
    n = 40
    ref = tau1(PROMPTS, n)

    async def scenario() -> list[list[Block]]:
        return list(await asyncio.gather(*(collect(rep, req(f"x{i}", p, n, profile="exact"))
                                           for i, p in enumerate(PROMPTS))))

    streams = asyncio.run(scenario())
    assert [tokens(s) for s in streams] == ref
    taus = {b.tau for s in streams for b in s}
    gates = {b.min_confidence for s in streams for b in s}
    assert len(taus) >= 2 and gates == {0.0, 0.6}, (taus, gates)  # the controller did move both
    assert any(len({b.tau for b in s}) >= 2 for s in streams)  # … within one request
    drafted = sum(s[-1].usage.drafted_tokens for s in streams)
    accepted = sum(s[-1].usage.accepted_tokens for s in streams)
    assert drafted > 0 and 0 < accepted <= drafted
    for s in streams:  # every token is an accepted draft or the verifier's own
        assert s[-1].usage.accepted_tokens + s[-1].usage.heads == s[-1].usage.completion_tokens == n


def scrape(rep: DMTDReplica) -> dict[str, float]:
    """The replica's Prometheus exposition: samples summed over label sets, and per ``name{label=value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(rep.telemetry.endpoint.exposition()):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            for k, v in s.labels.items():
                if k in ("position",):
                    key = f"{s.name}{{{k}={v}}}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def test_draft_metrics_count_what_was_streamed():
    """Exact requests (one ended early by a stop token inside its drafts) beside a gated one: the replica's
    draft counters, per-position counters and accepted-per-cycle histogram equal the streamed blocks."""
    cfg = ControllerConfig(tau_min=1, tau_max=4, rest_tau=4, hold_steps=10**9)
    rep = make_replica(cfg)
    n = 32
    ref = tau1(PROMPTS, n)
    stop = ref[1][9]
    before = scrape(rep)

    async def scenario() -> list[list[Block]]:
        reqs = [req("e0", PROMPTS[0], n, profile="exact"),
                req("e1", PROMPTS[1], n, profile="exact", stop_token_ids=[stop]),
                req("e2", PROMPTS[2], n, profile="exact", min_confidence=0.5),
                req("g3", PROMPTS[3], n, min_confidence=0.3)]
        return list(await asyncio.gather(*(collect(rep, r) for r in reqs)))

    streams = asyncio.run(scenario())
    after = scrape(rep)

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    exact = streams[:3]
    assert tokens(exact[0]) == ref[0] and tokens(exact[2]) == ref[2]
    assert tokens(exact[1]) == ref[1][: ref[1].index(stop) + 1] and exact[1][-1].finish_reason == "stop"
    blocks = [b for s in exact for b in s]
    drafted, accepted = sum(b.num_drafted for b in blocks), sum(b.num_accepted for b in blocks)
    assert drafted > 20 and 0 < accepted < drafted  # real acceptance, real rejections
    assert d("dmtd_drafted_tokens_total") == drafted == sum(s[-1].usage.drafted_tokens for s in exact)
    assert d("dmtd_accepted_tokens_total") == accepted == sum(s[-1].usage.accepted_tokens for s in exact)
    checked = [b for b in blocks if b.num_drafted]
    assert d("dmtd_accepted_per_cycle_count") == len(checked) and d("dmtd_accepted_per_cycle_sum") == accepted
    for p in range(1, 4):
        assert d(f"dmtd_drafted_by_position_total{{position={p}}}") == sum(b.num_drafted >= p for b in checked)
        assert d(f"dmtd_accepted_by_position_total{{position={p}}}") == sum(b.num_accepted >= p for b in checked)
    assert d("dmtd_drafted_by_position_total") == drafted and d("dmtd_accepted_by_position_total") == accepted
    assert not any(k.endswith("{position=4}") for k in after)  # τ ≤ 4: three tail positions
    assert d("dmtd_accepted_by_position_total{position=1}") > d("dmtd_accepted_by_position_total{position=3}")
    # tokens counted are tokens streamed: every exact token is an accepted draft or the verifier's own
    streamed = sum(len(tokens(s)) for s in streams)
    assert d("dmtd_generated_tokens_total") == streamed
    exact_heads = sum(s[-1].usage.heads for s in exact)
    assert accepted + exact_heads == sum(len(tokens(s)) for s in exact)
    gated = streams[3]
    assert d("dmtd_head_steps_total") == exact_heads + gated[-1].usage.heads
    assert gated[-1].usage.drafted_tokens == 0 and all(b.num_drafted == 0 for b in gated)


def test_an_unknown_profile_is_refused_naming_the_field():
    import pytest

    from dmtd.serve.errors import RequestFailed

    rep = make_replica(ControllerConfig(tau_min=1, tau_max=4, rest_tau=3, hold_steps=10**9))
    with pytest.raises(RequestFailed) as e:
        asyncio.run(collect(rep, req("u", PROMPTS[0], 4, profile="fast")))
    assert e.value.field == "cycle.profile" and "quality, balanced, speed, exact, adaptive" in str(e.value)
