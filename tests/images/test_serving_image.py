"""The serving image: `dmtd serve` in it (Ray, embedded registry, gateway, replica) answers a gRPC Generate
stream and an OpenAI chat completion, on the loopback of a private network namespace (--network host)."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from openai import OpenAI

from dmtd.client import DMTDClient
from tests.images.podman import Container

START_TIMEOUT_S = 240.0  # measured: 18 s on an idle 2-core machine; Serve's start is slower on a loaded one


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_ready(container: Container, target: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT_S:
        if not container.running():
            pytest.fail(f"dmtd serve exited in the container:\n{container.logs()}")
        with grpc.insecure_channel(target) as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=2)
                return time.monotonic() - started
            except grpc.FutureTimeoutError:
                pass
        time.sleep(1)
    pytest.fail(f"dmtd serve did not listen on {target} in {START_TIMEOUT_S} s:\n{container.logs()}")


def test_dmtd_serve_answers_grpc_generate_and_openai_chat(netns: None, serving_image: str) -> None:
    grpc_port, http_port, metrics_port = free_ports(3)
    container = Container(serving_image, ["--shm-size", "1g"], [
        "dmtd", "serve", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
        "--metrics-port", str(metrics_port), "--ready-timeout-s", "120"]).start()
    target = f"127.0.0.1:{grpc_port}"
    try:
        up_s = wait_ready(container, target)
        with DMTDClient(target, timeout_s=120) as c:
            blocks = list(c.generate(messages=[{"role": "user", "content": "Name a colour."}], max_new_tokens=12))
            variants = [v.name for v in c.list_variants().variants]
        oa = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=120)
        model = oa.models.list().data[0].id
        chat = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=8)
    except Exception:
        print(container.logs())
        raise
    finally:
        container.stop()
    tokens = [t for b in blocks for t in b.token_ids]
    assert 1 <= len(tokens) <= 12 and all(1 <= b.k <= b.tau for b in blocks)
    assert "".join(b.text for b in blocks).strip() != ""
    assert blocks[-1].usage.completion_tokens == len(tokens)
    assert model in variants and blocks[0].variant == model
    assert chat.choices[0].message.content and chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8
    print(f"serving image: gRPC up {up_s:.1f} s after start")
