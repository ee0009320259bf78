"""Ready means warm at every probe: gRPC health, ``/healthz`` and ``/v1/models`` say no until a request reached a warm
replica; a client that sends its first chat the moment ``/v1/models`` answers 200 on a fresh ``dmtd serve`` gets a
TTFT within 2x the steady one (``dmtd bench ready``, run here as a user runs it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dmtd.serve.readiness import Readiness

ROOT = Path(__file__).resolve().parents[2]


async def _health_status(target: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


def test_grpc_health_is_not_serving_until_the_warm_up_succeeds_and_again_while_draining():
    async def run() -> list[object]:
        ready = await Readiness(("dmtd.v1.GenerateService", "")).start()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(ready.health, server)
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        gate = asyncio.Event()
        calls: list[int] = []

        async def warm() -> dict[str, float]:
            calls.append(1)
            if len(calls) == 1:  # the first try meets no replica yet
                raise RuntimeError("no replica of smol yet")
            await gate.wait()
            return {"smol": 0.5}

        seen: list[object] = [await _health_status(target), await _health_status(target, "dmtd.v1.GenerateService")]
        task = asyncio.get_running_loop().create_task(ready.become_ready(warm, retry_s=0.01))
        while len(calls) < 2:
            await asyncio.sleep(0.01)
        seen += [await _health_status(target), ready.ready]  # warming: still no
        gate.set()
        await ready.wait(5)
        await task
        seen += [await _health_status(target), await _health_status(target, "dmtd.v1.GenerateService"), ready.ready,
                 ready.state()["warm_s"]]
        await ready.drain()
        seen += [await _health_status(target), ready.ready, ready.state()["draining"]]
        await server.stop(None)
        return seen

    ns, s = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    assert asyncio.run(run()) == [ns, ns, ns, False, s, s, True, {"smol": 0.5}, ns, False, True]


def test_a_drain_with_a_delay_says_not_ready_at_once_and_refuses_new_work_only_after_it():
    async def run() -> list[object]:
        ready = await Readiness().start()

        async def warm() -> dict[str, float]:
            return {"smol": 0.1}

        await ready.become_ready(warm)
        seen: list[object] = [ready.ready, ready.draining]
        t = time.monotonic()
        draining = asyncio.get_running_loop().create_task(ready.drain(delay_s=0.3))
        await asyncio.sleep(0.05)
        seen += [ready.ready, ready.leaving, ready.draining, ready.state()["draining"]]  # the probe's no, work taken
        await draining
        seen += [ready.draining, time.monotonic() - t >= 0.3]
        return seen

    assert asyncio.run(run()) == [True, False, False, True, False, True, True, True]


def test_the_running_stack_reports_ready_with_its_warm_up_on_every_probe(stack):
    from ray import serve

    state = serve.get_deployment_handle("Gateway", app_name=stack.app).wait_ready.remote(5).result()
    assert state["ready"] and not state["draining"] and state["ready_after_s"] > 0
    assert set(state["warm_s"]) == {"smol-d8", "http"} and all(v > 0 for v in state["warm_s"].values())
    health = requests.get(stack.http_url + "/healthz", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert requests.get(stack.http_url + "/v1/models", timeout=10).json()["data"][0]["id"] == "smol-d8"
    assert asyncio.run(_health_status(stack.grpc_target)) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for unshare -n")
def test_a_first_chat_sent_at_the_first_200_of_v1_models_is_within_twice_the_steady_ttft(tmp_path):
    out = tmp_path / "ready.json"
    dmtd = str(Path(sys.executable).with_name("dmtd"))
    done = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up; exec {dmtd} bench ready --requests 5 "
                           f"--max-tokens 8 --json {out}"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["not_ready_503"] > 0  # the HTTP server was up and said "not yet" while the replica warmed
    assert r["healthz_ok_before_models"] == 0 and r["other"] == 0
    assert r["after"] == {"healthz": 200}
    assert len(r["ttfts_ms"]) == 5 and r["first_ttft_ms"] <= 2 * r["steady_ttft_ms"], r
