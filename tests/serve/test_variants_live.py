"""Variants of the stack's trunk registered, refused and retired while it serves (real Redis, Ray Serve, gRPC, HTTP):
the replica loads a registered variant live, which then answers by name through both APIs while a stream of another
runs on unchanged; corrupt files are refused naming the variant and why (on the request and in the registry), the
others unaffected; a retired variant finishes its requests in flight and then goes; a new replica loads the whole
registered set before it is ready."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests

from dmtd.client import DMTDClient
from tests.serve.conftest import VARIANT
from tests.variants.tails_helpers import make_variant

TRUNK = {"num_encoding_layers": 0, "num_thinking_layers": 22, "num_decoding_layers": 8}  # the stack's split
PROMPT = [{"role": "user", "content": "Name three planets and one fact about each."}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-variants")
    broken = make_variant(root / "smol-broken", "smol-broken", 13, **TRUNK)
    (broken / "adapter.safetensors").write_bytes(b"not the file the manifest hashed")
    return {"smol-lora-a": make_variant(root / "smol-lora-a", "smol-lora-a", 11, **TRUNK), "smol-broken": broken}


def variants_cli(stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dmtd", "variants", *args, "--registry", stack.registry_url],
                          capture_output=True, text=True, timeout=120)


def model_ids(stack) -> list[str]:
    return [m["id"] for m in requests.get(stack.http_url + "/v1/models", timeout=30).json()["data"]]


def wait_for(what, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return got


def chat(stack, model: str, **kw) -> requests.Response:
    return requests.post(stack.http_url + "/v1/chat/completions", timeout=300,
                      json={"model": model, "messages": PROMPT, "max_tokens": 24, "temperature": 0, **kw})


def stream_tokens(stack, out: list[int], n: int = 320) -> None:
    with DMTDClient(stack.grpc_target) as c:
        for b in c.generate(messages=PROMPT, variant=VARIANT, max_new_tokens=n, ignore_eos=True, tau_min=1,
                            tau_max=1, timeout_s=600):
            out.extend(b.token_ids)


def test_a_variant_registered_while_another_streams_answers_by_name_and_the_stream_is_unchanged(stack, dirs):
    running: list[int] = []
    t = threading.Thread(target=stream_tokens, args=(stack, running))
    t.start()
    wait_for(lambda: running)
    reg = variants_cli(stack, "register", str(dirs["smol-lora-a"]), "--status", "active")
    assert reg.returncode == 0, reg.stderr
    assert wait_for(lambda: "smol-lora-a" in model_ids(stack))
    overlapped = t.is_alive()
    t.join(600)
    again: list[int] = []
    stream_tokens(stack, again)
    assert overlapped  # the variant was loaded and routed while the stream ran
    assert len(running) == 320 and running == again  # ... and the stream's tokens are those it writes alone
    # by name, through HTTP and gRPC: the variant's exact profile (its default) writes the base model's answer
    r = chat(stack, "smol-lora-a")
    assert r.status_code == 200, r.text
    base = chat(stack, VARIANT, dmtd_profile="exact").json()["choices"][0]["message"]["content"]
    assert r.json()["model"] == "smol-lora-a" and r.json()["choices"][0]["message"]["content"] == base
    with DMTDClient(stack.grpc_target) as c:
        blocks = list(c.generate(messages=PROMPT, variant="smol-lora-a", max_new_tokens=24, timeout_s=300))
    assert blocks[-1].variant == "smol-lora-a" and "".join(b.text for b in blocks) == base
    report = stack_replica(stack).served_variants.remote().result()
    assert report["served"]["smol-lora-a"]["nbytes"] > 50e6 and report["served"]["smol-lora-a"]["load_s"] > 0


def test_corrupt_files_are_refused_naming_the_variant_and_the_others_serve(stack, dirs):
    reg = variants_cli(stack, "register", str(dirs["smol-broken"]), "--status", "active", "--no-verify")
    assert reg.returncode == 0, reg.stderr
    report = wait_for(lambda: (r := stack_replica(stack).served_variants.remote().result())["failed"].get(
        "smol-broken") and r)
    assert "checksum mismatch" in report["failed"]["smol-broken"]
    r = wait_for(lambda: [got] if (got := chat(stack, "smol-broken")).status_code == 404 else None)[0]
    assert "smol-broken" in r.text and "checksum mismatch" in r.text
    with DMTDClient(stack.grpc_target) as c, pytest.raises(grpc.RpcError) as e:
        list(c.generate(messages=PROMPT, variant="smol-broken", max_new_tokens=4, timeout_s=60))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "smol-broken" in (e.value.details() or "")
    shown = variants_cli(stack, "show", "smol-broken", "--json")
    assert "checksum mismatch" in shown.stdout
    assert "smol-broken" not in model_ids(stack)
    assert chat(stack, "smol-lora-a").status_code == 200 and chat(stack, VARIANT).status_code == 200
    unknown = chat(stack, "no-such-variant")
    assert unknown.status_code == 404 and "no-such-variant" in unknown.text


def test_a_new_replica_loads_the_registered_set_before_it_is_ready(stack):
    import torch

    from dmtd.serve.engine_builder import EngineBuilder
    from dmtd.serve.replica import DMTDReplica
    from dmtd_contract.serve_config import EngineSettings

    threads = torch.get_num_threads()
    builder = EngineBuilder(variant="none", decoding_layers=8, tau_max=4, torch_threads=1,
                            settings=EngineSettings(max_num_seqs=2, max_model_len=256, dtype="float32"))
    try:
        replica = DMTDReplica(builder, registry_url=stack.registry_url, variant=VARIANT, name="new-replica")
    finally:
        torch.set_num_threads(threads)
    report = replica.variants.set.report()  # read as its constructor left it: before it could serve
    assert list(report["served"]) == ["smol-lora-a"] and "checksum mismatch" in report["failed"]["smol-broken"]
    assert report["served"]["smol-lora-a"]["nbytes"] > 50e6
    replica.loop.worker.executor.shutdown(wait=True)


def test_retiring_a_variant_under_load_fails_no_request_and_then_it_goes(stack):
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, stack, "smol-lora-a", max_tokens=32) for _ in range(4)]
        wait_for(lambda: stack.replica_stats()["active"] >= 4)  # all four in flight at the replica
        assert variants_cli(stack, "retire", "smol-lora-a").returncode == 0
        assert [f.result().status_code for f in futures] == [200] * 4
    wait_for(lambda: "smol-lora-a" not in stack_replica(stack).served_variants.remote().result()["served"])
    assert wait_for(lambda: chat(stack, "smol-lora-a").status_code == 404)
    assert variants_cli(stack, "retire", "smol-broken").returncode == 0
    assert wait_for(lambda: model_ids(stack) == [VARIANT])


def stack_replica(stack):
    from ray import serve

    return serve.get_deployment_handle("DMTDReplica", app_name=stack.app)
