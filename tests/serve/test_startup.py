"""Start-up that survives a busy machine: waits sized for a loaded node, a retry, a one-line error."""

from __future__ import annotations

import argparse

import pytest

from dmtd.serve.local import (
    LEAN_RAY_ENV,
    READY_ENV,
    StartupError,
    add_serve_args,
    prepare_environment,
    start_with_retry,
)


def test_a_failed_start_is_retried_then_named_in_one_line():
    attempts: list[int] = []
    cleanups: list[int] = []
    lines: list[str] = []

    def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("ActorDiedError: The actor died because it was killed by ray.kill\n(never ran)")

    start_with_retry(flaky, 2, lambda: cleanups.append(1), lambda: "Serve proxy on node n1 (UNHEALTHY)", lines.append)
    assert len(attempts) == 2 and len(cleanups) == 1 and "retrying (1/2)" in lines[0]

    def dead() -> None:
        raise RuntimeError("Traceback (most recent call last):\n  ...\nActorDiedError: killed by ray.kill")

    with pytest.raises(StartupError) as e:
        start_with_retry(dead, 2, lambda: None, lambda: "Serve proxy on node n1 (UNHEALTHY)", lines.append)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Serve proxy on node n1 (UNHEALTHY) did not come up after 2 attempt")
    assert msg.endswith("ActorDiedError: killed by ray.kill")


def test_readiness_waits_are_sized_for_a_loaded_node_and_configurable():
    args = argparse.ArgumentParser()
    add_serve_args(args)
    ns = args.parse_args([])
    assert ns.ready_timeout_s == 60.0 and ns.start_attempts == 2 and ns.host == "127.0.0.1"
    env: dict[str, str] = {}
    prepare_environment(ns.ready_timeout_s, env)
    assert all(env[v] == "60.0" for v in READY_ENV) and env["DMTD_SERVE_INTERNAL_HOST"] == "127.0.0.1"
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"  # Serve's controller off the decoding cores
    env = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
    prepare_environment(30, env)  # an operator's own setting wins
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "120" and env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
    assert env["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "30"


def test_ray_bookkeeping_is_off_unless_asked_for():
    env: dict[str, str] = {}
    prepare_environment(60, env)
    assert env["RAY_enable_metrics_collection"] == "0" and env["RAY_enable_task_events"] == "0"
    assert all(env[k] == v for k, v in LEAN_RAY_ENV.items())
    env = {"DMTD_RAY_BOOKKEEPING": "1"}
    prepare_environment(60, env)
    assert not set(LEAN_RAY_ENV) & set(env)
    env = {"RAY_enable_metrics_collection": "1"}  # an operator's own setting wins here too
    prepare_environment(60, env)
    assert env["RAY_enable_metrics_collection"] == "1" and env["RAY_enable_task_events"] == "0"


def test_the_stack_runs_without_rays_log_monitor_and_still_serves(stack):
    import psutil
    from ray._private import worker as ray_worker

    from dmtd.client import DMTDClient

    node = ray_worker._global_node
    assert node is not None and not node.all_processes.get("log_monitor")
    procs = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True) if p.is_running()]
    assert any("gcs_server" in c for c in procs)  # the node is there (so the search below looked)
    assert not any("log_monitor.py" in c for c in procs)
    with DMTDClient(stack.grpc_target) as c:
        blocks = list(c.generate(messages=[{"role": "user", "content": "Say hi."}], max_new_tokens=6,
                                 tau_min=1, tau_max=1, ignore_eos=True))
    assert sum(len(b.token_ids) for b in blocks) == 6 and blocks[-1].usage.completion_tokens == 6


def test_the_gateways_http_server_answers_on_its_port_and_names_a_taken_one() -> None:
    """The OpenAI routes on the gateway's own uvicorn server (no Serve proxy hop): it binds the port it is given
    (0: a free one) and serves; a port already taken is an error naming ``http_port``, not uvicorn's sys.exit."""
    import asyncio
    import json
    import socket
    import urllib.request

    from dmtd.serve.ingress import start_http_server

    async def run() -> None:
        server, task, port = await start_http_server("127.0.0.1", 0)
        assert port > 0
        url = f"http://127.0.0.1:{port}/openapi.json"  # FastAPI's own route: the others are the gateway's methods
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        assert "/v1/chat/completions" in json.loads(body)["paths"]
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            with pytest.raises(OSError, match=r"http_port: .* cannot listen on 127\.0\.0\.1:\d+"):
                await start_http_server("127.0.0.1", taken.getsockname()[1])
        finally:
            taken.close()
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
