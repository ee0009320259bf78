"""Ready means warm: a replica runs every pass kind before its constructor returns (Serve's readiness)."""

from __future__ import annotations

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.serve.warmup import warm_up
from tests.conftest import tiny_model
from tests.engine.test_exact import variant_of


def test_warm_up_runs_every_pass_kind_at_every_tau_and_leaves_nothing_behind():
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")
    model, verifier = variant_of(tiny_model(seed=3), 0.02, 3)
    engine = LLMEngine(model, None, dmtd, EngineConfig(max_num_seqs=8, max_model_len=128), default_tau=1,
                       eos_token_ids=[], verifier=verifier)
    seconds = warm_up(engine, tau_max=4, default_profile="exact")
    assert seconds > 0
    assert {"prefill", "decode", "draft", "verify"} <= set(engine.pass_stats)  # plain steps, tails, checks
    assert all(n > 0 for n, _ in engine.pass_stats.values())
    assert not engine.has_unfinished() and engine.seqs == {}  # every warm-up request is gone
    # and a request after it is served as usual
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, tau=1))[0]
    assert len(out.token_ids) == 4
