"""End to end over real sockets: gRPC client → Gateway (Ray Serve) → DMTD replica (Ray Serve) → engine."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from dmtd.client import DMTDClient, build_request
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.v1 import generate_pb2 as pb
from tests.serve.conftest import VARIANT

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def wait_idle(stack, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stack.replica_stats()
        if stats["active"] == 0 and stats["free_kv_rows"] == 8 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_greedy_stream_is_the_engines_own_tokens(stack, smollm2):
    sink = stack.gateway_info()["block_sink"]
    with DMTDClient(stack.grpc_target) as c:
        blocks = list(c.generate(messages=CHAT, max_new_tokens=24, tau_min=3, tau_max=3, min_confidence=0.0,
                                 ignore_eos=True))
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=1, max_model_len=1024))
    ref = engine.generate([CHAT], SamplingParams(max_new_tokens=24, tau=3, ignore_eos=True))[0]
    assert [t for b in blocks for t in b.token_ids] == ref.token_ids
    assert "".join(b.text for b in blocks) == ref.text
    assert [b.k for b in blocks] == [len(x) for x in ref.blocks] and all(b.tau == 3 for b in blocks)
    assert blocks[0].timings.ttft_ms > 0 and blocks[0].variant == VARIANT
    last = blocks[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 24
    assert last.usage.blocks == len(blocks) and last.usage.prompt_tokens == len(ref.prompt_token_ids)
    after = stack.gateway_info()["block_sink"]  # the replica pushed every block to the gateway's sink
    assert after["address"].startswith("127.0.0.1:") and after["frames"] - sink["frames"] == len(blocks)
    assert after["open"] == 0 and after["dropped"] == sink["dropped"]


def test_eight_concurrent_streams(stack):
    results: dict[int, list] = {}

    def run(i: int) -> None:
        with DMTDClient(stack.grpc_target) as c:
            results[i] = list(c.generate(prompt=f"Story number {i}:", max_new_tokens=16, ignore_eos=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(8))
    for blocks in results.values():
        assert sum(b.k for b in blocks) == 16 == blocks[-1].usage.completion_tokens
        assert [b.finish_reason != 0 for b in blocks].count(True) == 1
    assert wait_idle(stack)["active"] == 0


def test_cancel_mid_stream_frees_the_slot(stack):
    with DMTDClient(stack.grpc_target) as c:
        got = 0
        for _ in c.generate(prompt="Count to one thousand:", max_new_tokens=500, ignore_eos=True):
            got += 1
            if got == 3:
                break
    assert got == 3
    stats = wait_idle(stack)
    assert stats["active"] == 0 and stats["free_kv_rows"] == 8


def test_deadline_expires_cleanly(stack):
    with DMTDClient(stack.grpc_target) as c, pytest.raises(grpc.RpcError) as e:
        list(c.generate(prompt="A very long essay:", max_new_tokens=1000, ignore_eos=True, timeout_s=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(stack)["active"] == 0


def test_unknown_variant_and_bad_fields(stack):
    with DMTDClient(stack.grpc_target) as c:
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate(prompt="hi", variant="no-such-variant"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-variant" in e.value.details()
        cases = [({"prompt": ""}, "prompt"), ({"prompt": "hi", "max_new_tokens": 100000}, "max_new_tokens"),
                 ({"prompt": "hi", "temperature": -1.0}, "sampling.temperature"),
                 ({"prompt": "hi", "tau_min": 4, "tau_max": 2}, "cycle.tau_min"),
                 ({"prompt": "hi", "min_confidence": 2.0}, "cycle.min_confidence"),
                 ({"messages": [{"role": "robot", "content": "x"}]}, "chat.messages[0].role"),
                 ({"prompt": "word " * 1100}, "prompt")]
        for kwargs, field in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(c.generate(**kwargs))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (kwargs, e.value.details())
            assert e.value.details().startswith(field), (field, e.value.details())
        assert c.get_variant(VARIANT).name == VARIANT
        assert [v.name for v in c.list_variants().variants] == [VARIANT]
    assert wait_idle(stack)["active"] == 0


def test_overload_is_resource_exhausted_and_accepted_complete_once(stack):
    outcomes: list[tuple[str, object]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        ch = grpc.insecure_channel(stack.grpc_target)
        from dmtd.v1 import generate_pb2_grpc as pbg

        call = pbg.GenerateServiceStub(ch).Generate(build_request(prompt=f"Item {i}:", max_new_tokens=24,
                                                                  ignore_eos=True), timeout=120)
        try:
            blocks = list(call)
            with lock:
                outcomes.append(("ok", blocks))
        except grpc.RpcError as e:
            with lock:
                outcomes.append((e.code().name, dict(e.trailing_metadata() or ())))
        ch.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    ok = [b for kind, b in outcomes if kind == "ok"]
    rejected = [m for kind, m in outcomes if kind == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(rejected) == 16 and rejected and ok
    assert all("retry-after-ms" in m for m in rejected)
    for blocks in ok:  # every accepted request completes exactly once
        assert sum(1 for b in blocks if b.finish_reason) == 1 and sum(b.k for b in blocks) == 24
    assert wait_idle(stack)["active"] == 0


def test_openai_client_streaming_and_not(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [VARIANT]
    chat = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 16
    stream = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=16, temperature=0,
                                            stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream)
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model=VARIANT, prompt="The sky is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 8 or comp.choices[0].finish_reason == "stop"
    from openai import BadRequestError, NotFoundError

    with pytest.raises(BadRequestError, match="temperature"):
        client.completions.create(model=VARIANT, prompt="x", temperature=-3)
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_registry_change_reaches_replica_and_gateway_within_2s(stack):
    from dmtd_contract.registry import RegistryClient

    before = stack.replica_stats()
    with RegistryClient(stack.registry_url) as reg:
        reg.update(VARIANT, min_confidence=0.55, tau_max=2)
        t0 = time.monotonic()
        while True:
            stats = stack.replica_stats()
            if stats["rest_min_confidence"] == 0.55 and tuple(stats["tau_bounds"]) == (1, 2):
                break
            assert time.monotonic() - t0 < 2.0, stats
            time.sleep(0.05)
        assert stats["registry_revision"] > before["registry_revision"]
        with DMTDClient(stack.grpc_target) as c:
            info = c.get_variant(VARIANT)
            assert info.tau_max == 2 and abs(info.min_confidence - 0.55) < 1e-6 and info.is_default
            blocks = list(c.generate(prompt="Hello there", max_new_tokens=12, ignore_eos=True))
        assert all(b.tau <= 2 for b in blocks) and all(abs(b.min_confidence - 0.55) < 1e-6 for b in blocks)
        reg.update(VARIANT, min_confidence=0.0, tau_max=4)  # restore for the tests after this one


def test_replica_process_runs_with_passive_openmp_waits(stack):
    """``omp_wait_policy`` reaches the replica's process through its Ray runtime env (set before torch loads)."""
    from pathlib import Path

    found = {}
    own_net = os.readlink("/proc/self/ns/net")  # this test's stack: another engineer's may run beside it
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "DMTDReplica" not in cmd or os.readlink(proc / "ns" / "net") != own_net:
                continue
            env = dict(e.split("=", 1) for e in (proc / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in e)
        except OSError:
            continue
        found[proc.name] = env.get("OMP_WAIT_POLICY")
    assert found and set(found.values()) == {"PASSIVE"}, found


def test_zz_replica_killed_mid_stream_is_unavailable_then_restored(stack):
    import ray

    name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                if "DMTDReplica" in n["name"] and n["namespace"] == "serve")
    errors: list[grpc.RpcError] = []

    def consume() -> None:
        try:
            with DMTDClient(stack.grpc_target) as c:
                for _ in c.generate(prompt="Once upon a time", max_new_tokens=800, ignore_eos=True, timeout_s=60):
                    pass
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(2.0)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    t.join(30)
    assert not t.is_alive() and errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 90
    while True:  # Serve brings a new replica up; new requests then succeed
        try:
            with DMTDClient(stack.grpc_target) as c:
                blocks = list(c.generate(prompt="Hello", max_new_tokens=4, ignore_eos=True, timeout_s=30))
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "replica was not restored"
            time.sleep(1.0)
    assert sum(b.k for b in blocks) == 4


def test_exact_profile_streams_the_base_models_tokens(stack, smollm2):
    """CYCLE_PROFILE_EXACT: verified cycles on the replica; the tokens are τ = 1's and the last block names the
    verifier, with drafted and accepted counts per block and in the usage."""
    with DMTDClient(stack.grpc_target) as c:
        blocks = list(c.generate(messages=CHAT, max_new_tokens=24, tau_min=3, tau_max=3, min_confidence=0.0,
                                 ignore_eos=True, profile="exact"))
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=1, max_model_len=1024))
    ref = engine.generate([CHAT], SamplingParams(max_new_tokens=24, tau=1, ignore_eos=True))[0]
    assert [t for b in blocks for t in b.token_ids] == ref.token_ids
    assert all(b.k == b.num_accepted + 1 for b in blocks[1:])  # accepted drafts + the verifier's own token
    last = blocks[-1]
    assert last.verifier == "base" and last.usage.drafted_tokens == sum(b.num_drafted for b in blocks) > 0
    assert last.usage.accepted_tokens == sum(b.num_accepted for b in blocks)


def test_openai_dmtd_profile_exact_gives_the_base_text(stack, smollm2):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    exact = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=16, temperature=0,
                                           extra_body={"dmtd_profile": "exact", "tau_min": 3, "tau_max": 3})
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                       EngineConfig(max_num_seqs=1, max_model_len=1024))
    ref = engine.generate([CHAT], SamplingParams(max_new_tokens=16, tau=1))[0]
    assert exact.choices[0].message.content == ref.text
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=4, extra_body={"dmtd_profile": "x"})
    assert "dmtd_profile" in str(e.value)
