"""The exact profile's surface over the real stack: the registry's default profile, `dmtd generate --server
--profile`, and the replica's draft metrics over Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from dmtd.client import DMTDClient
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.outputs import GenerationResult
from dmtd.engine.sequence import SamplingParams
from tests.serve.conftest import VARIANT
from tests.serve.test_metrics import concurrent_streams, scrape, urls
from tests.serve.test_stack import CHAT, wait_idle


def base_tau1(smollm2, n: int, ignore_eos: bool = True) -> GenerationResult:
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=1, max_model_len=1024))
    return engine.generate([CHAT], SamplingParams(max_new_tokens=n, tau=1, ignore_eos=ignore_eos))[0]


def wait_for_default_profile(stack, profile: str) -> None:
    t0 = time.monotonic()
    while stack.replica_stats()["default_profile"] != profile:
        assert time.monotonic() - t0 < 5.0, "the registry change did not reach the replica"
        time.sleep(0.05)


def test_the_registrys_default_profile_serves_requests_that_name_none(stack, smollm2):
    from openai import OpenAI

    from dmtd_contract.registry import RegistryClient

    ref = base_tau1(smollm2, 16).token_ids
    with RegistryClient(stack.registry_url) as reg:
        assert reg.get(VARIANT).default_profile == "dmtd"
        reg.update(VARIANT, default_profile="exact")
        try:
            wait_for_default_profile(stack, "exact")
            with DMTDClient(stack.grpc_target) as c:
                info = c.get_variant(VARIANT)
                assert (info.default_profile, info.verifier) == ("exact", "base")
                unnamed = list(c.generate(messages=CHAT, max_new_tokens=16, tau_min=3, tau_max=3,
                                          min_confidence=0.0, ignore_eos=True))
                adaptive = list(c.generate(messages=CHAT, max_new_tokens=16, tau_min=3, tau_max=3,
                                           min_confidence=0.0, ignore_eos=True, profile="adaptive"))
            assert [t for b in unnamed for t in b.token_ids] == ref
            assert unnamed[-1].verifier == "base" and unnamed[-1].usage.drafted_tokens > 0
            assert adaptive[-1].verifier == "" and adaptive[-1].usage.drafted_tokens == 0
            client = OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
            text = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=16, temperature=0,
                                                  extra_body={"tau_min": 3, "tau_max": 3}).choices[0].message.content
            assert text == base_tau1(smollm2, 16, ignore_eos=False).text
        finally:
            reg.update(VARIANT, default_profile="dmtd")  # restore for the tests after this one
    wait_for_default_profile(stack, "dmtd")


def dmtd_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dmtd", "generate", *args], capture_output=True, text=True,
                          timeout=180)


def test_generate_server_profile_exact_compares_with_tau1(stack, smollm2):
    r = dmtd_cli("--server", stack.grpc_target, "--chat", CHAT[0]["content"], "--profile", "exact", "--tau", "3",
                 "--min-confidence", "0", "--max-new-tokens", "16", "--compare-tau1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["profile"] == "exact" and out["verifier"] == "base" and out["num_drafted"] > 0
    assert out["tokens_match_tau1"] is True and out["token_ids"] == out["tau1_token_ids"]
    assert out["token_ids"] == base_tau1(smollm2, 16, ignore_eos=False).token_ids
    assert out["tau"] == 3 and out["speedup_vs_tau1"] > 0
    assert "tokens identical to τ = 1's (base model)" in r.stderr and "drafts accepted" in r.stderr
    for profile in ("dmtd", "quality", "speed"):  # the controller's profiles: tails emit their tokens
        r = dmtd_cli("--server", stack.grpc_target, "--prompt", "Once upon a time", "--profile", profile,
                     "--max-new-tokens", "6", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["profile"] == "dmtd" and "verifier" not in out and len(out["token_ids"]) <= 6


def test_draft_metrics_over_prometheus_add_up(stack):
    _, rep_url = urls(stack)
    wait_idle(stack)
    before = scrape(rep_url)
    # τ = 4 both: a row still drafting joins a check most rows make (align_checks), so a τ = 3 companion would cut
    # a τ = 4 row's cycles to two drafts
    streams = concurrent_streams(stack, [dict(prompt=f"Fact {i}: the", max_new_tokens=14, ignore_eos=True,
                                              tau_min=4, tau_max=4, min_confidence=0.0, profile="exact")
                                         for i in range(2)])
    wait_idle(stack)
    after = scrape(rep_url)

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    blocks = [b for s in streams.values() for b in s]
    drafted, accepted = sum(b.num_drafted for b in blocks), sum(b.num_accepted for b in blocks)
    assert drafted > 0 and d("dmtd_drafted_tokens_total") == drafted
    assert d("dmtd_accepted_tokens_total") == accepted == sum(s[-1].usage.accepted_tokens for s in streams.values())
    checked = [b for b in blocks if b.num_drafted]
    assert d("dmtd_accepted_per_cycle_count") == len(checked) and d("dmtd_accepted_per_cycle_sum") == accepted
    for p in (1, 2, 3):
        assert d(f"dmtd_drafted_by_position_total{{position={p}}}") == sum(b.num_drafted >= p for b in checked)
        assert d(f"dmtd_accepted_by_position_total{{position={p}}}") == sum(b.num_accepted >= p for b in checked)
    assert d("dmtd_drafted_by_position_total{position=3}") > 0  # a τ = 4 request drafted three tails
    streamed = sum(len(b.token_ids) for b in blocks)
    assert d("dmtd_generated_tokens_total") == streamed == 28
    assert d("dmtd_accepted_tokens_total") + d("dmtd_head_steps_total") == streamed
    assert d("dmtd_tail_steps_total") == accepted


def test_an_out_of_range_draft_threshold_is_refused_before_any_work(stack):
    """gRPC INVALID_ARGUMENT naming cycle.min_confidence, HTTP 400 naming min_confidence: nothing admitted."""
    import urllib.error
    import urllib.request

    import grpc
    import pytest

    wait_idle(stack)
    accepted, steps = stack.gateway_info()["accepted"], stack.replica_stats()["steps"]
    with DMTDClient(stack.grpc_target) as c:
        for value in (1.5, -0.25, float("nan")):
            with pytest.raises(grpc.RpcError) as e:
                list(c.generate(prompt="hi", max_new_tokens=4, profile="exact", min_confidence=value))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (e.value.details() or "").startswith("cycle.min_confidence: must be in [0.0, 1.0], got ")
    body = json.dumps({"model": VARIANT, "messages": CHAT, "max_tokens": 4, "dmtd_profile": "exact",
                       "min_confidence": 1.5}).encode()
    request = urllib.request.Request(stack.http_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(http.value.read())["error"]
    assert http.value.code == 400 and error["param"] == "min_confidence" and "min_confidence" in error["message"]
    assert stack.gateway_info()["accepted"] == accepted and stack.replica_stats()["steps"] == steps
