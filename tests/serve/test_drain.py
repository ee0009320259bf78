"""Graceful drain: a gateway asked to drain — by a pod's preStop (dmtd.serve.pod_drain: the trigger file it watches),
or by Serve stopping it (``dmtd serve`` on SIGTERM, a deployment deleted or replaced) — says not ready at once,
refuses new gRPC calls and HTTP requests, and lets the stream in flight finish; then it is gone.
A second gateway app over the shared stack's replica is the one drained (the stack's own keeps serving): its pod's
preStop drains it (within 0.2 s: Serve's own stop took seconds to reach it, longer than a stream of this fast
replica), then Serve deletes it, whose shutdown finds the drain done and returns its result."""

from __future__ import annotations

import threading
import time

import grpc
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dmtd.client import DMTDClient
from dmtd.serve import pod_drain
from dmtd.v1 import generate_pb2 as pb
from tests.serve.conftest import VARIANT, free_port

MAX_TOKENS = 192


def health(target: str) -> str:
    """``grpc.health.v1`` of the whole server: its status name, or the RPC error's code name."""
    with grpc.insecure_channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.RpcError as e:
            return str(e.code().name)


def test_a_draining_gateway_finishes_its_stream_and_takes_no_new_work(stack, tmp_path):
    from ray import serve

    from dmtd.serve.app import GatewayIngress

    grpc_port, http_port = free_port(), free_port()
    target, url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    trigger = tmp_path / "drain"
    replica = serve.get_deployment_handle("DMTDReplica", app_name=stack.app)
    gateway = serve.deployment(GatewayIngress, name="Gateway", num_replicas=1, graceful_shutdown_timeout_s=60,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {
                                   "env_vars": {pod_drain.DRAIN_FILE_ENV: str(trigger)}}})
    app = gateway.bind({VARIANT: replica}, [{"name": VARIANT, "status": "active", "traffic_weight": 1.0}], VARIANT,
                       "127.0.0.1", grpc_port, 10, None, None, None, None, None, None, None, "auto", "127.0.0.1",
                       http_port)
    serve.run(app, name="dmtd-drain", route_prefix="/drain")
    serve.get_deployment_handle("Gateway", app_name="dmtd-drain").wait_ready.remote(300).result()
    assert health(target) == "SERVING" and requests.get(url + "/healthz", timeout=10).status_code == 200

    blocks: list[pb.TokenBlock] = []
    errors: list[str] = []

    def stream() -> None:
        try:
            with DMTDClient(target) as c:
                for b in c.generate(prompt="Count slowly from one to one hundred:", ignore_eos=True,
                                    max_new_tokens=MAX_TOKENS, tau_min=1, tau_max=1, timeout_s=300):
                    blocks.append(b)
        except grpc.RpcError as e:
            errors.append(f"{e.code().name}: {e.details()}")

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 120
    while not blocks and not errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocks, errors
    hook: list[dict[str, object]] = []  # the preStop's result; no metrics endpoint here: only the gateway to wait on
    pre_stop = threading.Thread(target=lambda: hook.append(pod_drain.drain_pod(
        trigger, f"http://127.0.0.1:{free_port()}/metrics", timeout_s=120, quiet_s=0.2)))
    pre_stop.start()
    while health(target) == "SERVING" and time.monotonic() < deadline:
        time.sleep(0.02)
    seen_while_draining = health(target)
    refused_grpc = ""
    try:
        with DMTDClient(target) as c:
            list(c.generate(prompt="Hello", max_new_tokens=4, timeout_s=30))
    except grpc.RpcError as e:
        refused_grpc = e.code().name
    chat = {"model": VARIANT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    try:
        refused_http = requests.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code
    except requests.ConnectionError:
        refused_http = 0  # the listener already closed: also refused
    in_flight_when_refused = not blocks[-1].finish_reason
    streaming.join(120)
    pre_stop.join(120)
    t = time.monotonic()
    serve.delete("dmtd-drain")  # Serve's graceful shutdown: the drain is done already
    delete_s = time.monotonic() - t

    assert seen_while_draining in ("NOT_SERVING", "UNAVAILABLE")
    assert refused_grpc == "UNAVAILABLE" and refused_http in (503, 0)
    assert in_flight_when_refused  # the refusals came while the first stream was still going
    assert errors == [] and sum(len(b.token_ids) for b in blocks) == MAX_TOKENS  # it finished, whole
    assert blocks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    (done,) = hook
    assert done["quiet"] and done["gateway"] == {"in_flight": 1, "cut": 0, "seconds": done["gateway"]["seconds"]}
    assert "dmtd-drain" not in serve.status().applications and delete_s < 30, delete_s
    assert health(stack.grpc_target) == "SERVING"  # the stack's own gateway and the replica serve on
