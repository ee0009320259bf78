"""The operator's RayService run as KubeRay runs it: a gateway on each ingress pod, replicas on the workers, gRPC
and OpenAI through an ingress pod's addresses (the gateway Service's endpoints)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from dmtd.client import AsyncDMTDClient, DMTDClient
from dmtd_contract.registry import RegistryClient, VariantSpec
from dmtd_operator import render
from dmtd_operator.resources import GATEWAY_HTTP_PORT
from tests.cluster import kuberay
from tests.cluster.burst import BurstPlan, run_burst
from tests.cluster.cluster import RayCluster
from tests.cluster.conftest import NAME, NAMESPACE, SPEC, render_target
from tests.cluster.load import ClosedLoop, StreamResult, first_success, stream
from tests.cluster.prom import PrometheusProcess
from tests.cluster.redis_proc import RedisProcess


def test_grpc_stream_and_openai_call_through_the_cluster(cluster: RayCluster) -> None:
    gateway = cluster.running_replicas("Gateway")
    replicas = cluster.running_replicas("DMTDReplica")
    assert sorted(r["node_ip"] for r in gateway) == sorted(n.ip for n in cluster.ingress)  # one on each, not the head
    assert len(replicas) == 1 and replicas[0]["node_ip"] in {w.ip for w in cluster.workers}
    with DMTDClient(cluster.gateway, timeout_s=120) as c:
        blocks = list(c.generate(messages=[{"role": "user", "content": "Name a colour."}], max_new_tokens=12))
    tokens = [t for b in blocks for t in b.token_ids]
    assert 1 <= len(tokens) <= 12 and blocks[-1].usage.completion_tokens == len(tokens)
    # the gateway's own HTTP server, which the gateway Service's `http` port targets
    oa = OpenAI(base_url=f"http://{cluster.ingress[-1].ip}:{GATEWAY_HTTP_PORT}/v1", api_key="unused", timeout=120)
    model = oa.models.list().data[0].id
    chat = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
    assert chat.choices[0].message.content and chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8
    print(f"cluster: nodes ready in {cluster.start_s:.1f} s, app running {cluster.deploy_s:.1f} s after submit")


VARIANT = SPEC["variants"][0]["name"]


def register_variant(url: str) -> None:
    """The served variant's registry entry, from the manifest the image ships (as `dmtd registry register`)."""
    manifest = Path(__file__).resolve().parents[2] / "platform/dmtd/variants/shipped/smollm2-135m-dmtd/variant.json"
    with RegistryClient(url) as reg:
        if VARIANT not in {e.name for e in reg.list()}:
            spec = VariantSpec.from_manifest(json.loads(manifest.read_text()), name=VARIANT, tau_min=1, tau_max=4)
            reg.register(spec, status="active", traffic_weight=1.0)
            reg.set_default(VARIANT)


def wait_variant(target: str, ok: Callable[[Any], bool], timeout_s: float = 20) -> Any:
    """The gateway's view of the variant (ListVariants) once ``ok`` holds for it."""
    deadline = time.monotonic() + timeout_s
    with DMTDClient(target, timeout_s=10) as c:
        while True:
            (info,) = [v for v in c.list_variants().variants if v.name == VARIANT]
            if ok(info) or time.monotonic() > deadline:
                assert ok(info), info
                return info
            time.sleep(0.3)


def replica_nodes(cluster: RayCluster) -> dict[str, str]:
    """`TokenBlock.replica` ("replica-<host>-<pid>") → the node address of each RUNNING replica."""
    running = cluster.running_replicas("DMTDReplica")
    names = {f"replica-{cluster.node_of(r['node_ip']).spec.name}-{r['pid']}": r["node_ip"] for r in running}
    assert len(names) == len(running), f"two replicas share a name: {running}"
    return names


def scale_to(cluster: RayCluster, registry: RedisProcess, replicas: int) -> None:
    """What the operator does on a new decision: render the RayService at ``replicas``; KubeRay submits it."""
    cluster.submit(kuberay.serve_config(render.ray_service(render_target(registry.url, replicas=replicas))))


def test_scale_up_under_closed_loop_load_fails_no_request(cluster: RayCluster, registry: RedisProcess) -> None:
    target = cluster.gateway

    async def run() -> tuple[list[StreamResult], float, float]:
        loop = ClosedLoop(target, clients=4, max_new_tokens=12).start()
        await asyncio.sleep(5)
        t0 = time.monotonic()
        await asyncio.to_thread(scale_to, cluster, registry, 2)
        up_s = await asyncio.to_thread(cluster.wait_app, "dmtd", 240, {"DMTDReplica": 2})
        scaled = time.monotonic()
        await asyncio.sleep(6)
        return await loop.stop(), up_s, scaled - t0

    results, up_s, _ = asyncio.run(run())
    nodes = replica_nodes(cluster)
    assert sorted(nodes.values()) == sorted(w.ip for w in cluster.workers)  # one replica on each worker
    failed = [r for r in results if not r.ok or r.tokens != r.expected_tokens]
    assert results and not failed, failed[:3]
    served_by = {nodes.get(r.replica) for r in results}
    assert {w.ip for w in cluster.workers} <= served_by  # the new replica took part of the load
    print(f"scale-up 1 -> 2 under load: {len(results)} requests, 0 failed; second replica running {up_s:.1f} s "
          f"after the new serveConfigV2")


def test_worker_killed_under_16_streams(cluster: RayCluster) -> None:
    target = cluster.gateway
    nodes = replica_nodes(cluster)
    assert len(nodes) == 2
    victim = cluster.node_of(nodes[next(iter(nodes))])
    killed = {r["replica_id"] for r in cluster.running_replicas("DMTDReplica") if r["node_ip"] == victim.ip}

    async def run() -> tuple[list[StreamResult], tuple[float, float], tuple[float, int]]:
        async with AsyncDMTDClient(target, timeout_s=300) as client:
            firsts = [asyncio.Event() for _ in range(16)]
            tasks = [asyncio.create_task(stream(client, i, 160, firsts[i])) for i in range(16)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 180)  # all 16 are streaming
            t_cmd = time.time()
            died = await asyncio.to_thread(victim.kill)
            new = await first_success(target, 5.0)
            results = list(await asyncio.gather(*tasks))
            return results, (t_cmd, died), new

    results, (t_cmd, died), (new_ok, new_failed) = asyncio.run(run())
    new_s = new_ok - died
    on_victim = [r for r in results if nodes.get(r.replica) == victim.ip]
    others = [r for r in results if nodes.get(r.replica) != victim.ip]
    assert on_victim and others, [(r.replica, r.code) for r in results]
    # from the moment the container died (podman's FinishedAt), not from the kill command: `podman kill` itself
    # took 0.3-1.4 s on the loaded 2-core machine
    late = [(r.code, round(r.ended_wall - died, 2)) for r in on_victim
            if r.code != "UNAVAILABLE" or r.ended_wall - died > 1]
    assert not late, late
    assert all(r.ok and r.tokens == r.expected_tokens for r in others), [(r.code, r.tokens) for r in others]
    worst = max(r.ended_wall - died for r in on_victim)
    assert new_s <= 5
    print(f"node loss: {len(on_victim)} streams on the killed worker ended UNAVAILABLE within {worst:.2f} s of its "
          f"death ({died - t_cmd:.2f} s after `podman kill` was called); {len(others)} on the other worker "
          f"completed; a new request succeeded {new_s:.2f} s after its death ({new_failed} failed before)")
    t_back = time.monotonic()
    victim.start()  # the pod comes back: a new container at the same address, a new Ray node
    wait_new_replica(cluster, victim.ip, killed, 60)
    back_s = time.monotonic() - t_back
    assert back_s <= 60 and sorted(replica_nodes(cluster).values()) == sorted(w.ip for w in cluster.workers)
    print(f"node return: a new replica running on it {back_s:.1f} s after the worker's container started again")


def wait_new_replica(cluster: RayCluster, ip: str, old_ids: set[str], timeout_s: float) -> float:
    """Seconds until a replica Serve started after ``old_ids`` is RUNNING on ``ip`` and no old one is listed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        reps = cluster.replicas("DMTDReplica")
        fresh = [r for r in reps if r["replica_id"] not in old_ids and r.get("node_ip") == ip
                 and r["state"] == "RUNNING"]
        if fresh and not any(r["replica_id"] in old_ids for r in reps):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"no new replica on {ip} in {timeout_s} s: {cluster.replicas('DMTDReplica')}")


def test_scale_down_lets_in_flight_streams_on_the_drained_replica_finish(cluster: RayCluster,
                                                                        registry: RedisProcess) -> None:
    target = cluster.gateway
    nodes = replica_nodes(cluster)
    assert len(nodes) == 2

    async def run() -> tuple[list[StreamResult], set[str]]:
        async with AsyncDMTDClient(target, timeout_s=300) as client:
            firsts = [asyncio.Event() for _ in range(12)]
            tasks = []
            for i in range(12):  # staggered: Serve's queue-length cache, which routing reads, catches up
                tasks.append(asyncio.create_task(stream(client, 100 + i, 64, firsts[i])))
                await asyncio.sleep(0.4)
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 180)
            await asyncio.to_thread(scale_to, cluster, registry, 1)
            results = list(await asyncio.gather(*tasks))
            return results, {r.replica for r in results}

    results, serving = asyncio.run(run())
    assert serving == set(nodes), [r.replica for r in results]  # both replicas held streams when it was submitted
    cluster.wait_app("dmtd", 120, {"DMTDReplica": 1})
    (kept,) = replica_nodes(cluster)
    drained = [r for r in results if r.replica != kept]
    assert drained, "no stream ran on the replica Serve stopped"
    assert all(r.ok and r.tokens == r.expected_tokens for r in results), [(r.replica, r.code, r.tokens)
                                                                         for r in results]
    print(f"scale-down 2 -> 1: {len(drained)} in-flight streams on the drained replica all finished "
          f"({max(r.ended - r.started for r in drained):.1f} s the longest)")


def test_redis_restart_under_load_fails_no_request(cluster: RayCluster, registry: RedisProcess) -> None:
    """The registry's Redis goes away for 3 s under load and comes back with its data (the chart's StatefulSet
    keeps it on a volume): routing keeps its last state, the gateway's watcher reconnects and follows a change
    written after the restart."""
    target = cluster.gateway
    register_variant(registry.url)
    tau_before = wait_variant(target, lambda v: v.revision > 0).tau_max

    async def run() -> tuple[list[StreamResult], float]:
        loop = ClosedLoop(target, clients=3, max_new_tokens=12).start()
        await asyncio.sleep(3)
        await asyncio.to_thread(registry.stop)
        await asyncio.sleep(3)
        await asyncio.to_thread(registry.start)
        await asyncio.to_thread(registry.wait)
        t_up = time.monotonic()
        with RegistryClient(registry.url) as reg:
            reg.update(VARIANT, tau_max=tau_before - 1)

        def followed_s() -> float:
            wait_variant(target, lambda v: v.tau_max == tau_before - 1)
            return time.monotonic() - t_up

        seen_s = await asyncio.to_thread(followed_s)
        await asyncio.sleep(2)
        return await loop.stop(), seen_s

    results, seen_s = asyncio.run(run())
    failed = [(r.code, r.detail) for r in results if not r.ok or r.tokens != r.expected_tokens]
    assert results and not failed, failed[:3]
    with RegistryClient(registry.url) as reg:
        reg.update(VARIANT, tau_max=tau_before)
    print(f"redis restart: {len(results)} requests under load, 0 failed; the gateway followed a change written "
          f"after the restart {seen_s:.1f} s later")


def test_burst_scaled_by_the_policy_from_prometheus(cluster: RayCluster, registry: RedisProcess,
                                                    prometheus: PrometheusProcess,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 3x burst: every 10 s the operator's metrics source queries Prometheus (its PromQL), the policy decides,
    and the decision (replicas, tau) is rendered and submitted as KubeRay would; SLO attainment and
    replica-seconds beside `dmtd bench autoscale`'s prediction for the same trace."""
    (replica,) = cluster.running_replicas("DMTDReplica")
    health = prometheus.target_health()
    assert len(health) == len(cluster.nodes) and all(health[f"http://{ip}:9464/metrics"] == "up" for ip in
                                                     [*(n.ip for n in cluster.ingress), replica["node_ip"]]), health
    plan = BurstPlan()
    spec = plan.spec(SPEC)
    run = asyncio.run(run_burst(cluster, plan, spec, prometheus.url, registry.url, NAME, NAMESPACE,
                                start=(1, 4)))
    predicted = plan.predicted(tmp_path_factory.mktemp("sim"))
    windows = [e.window for e in run.evaluations if e.window is not None]
    assert windows and max(w.requests_s for w in windows) > 0 and max(w.ready_replicas or 0 for w in windows) >= 1
    assert any(w.ttft_p95_ms is not None and w.itl_p95_ms is not None for w in windows)
    assert max(e.decision.replicas for e in run.evaluations) == 2  # the burst asked for the second replica
    assert max(n for _, n in run.running) == 2  # and the cluster ran it
    failed = [(r.code, r.detail) for r in run.results if not r.ok or r.tokens != r.expected_tokens]
    assert not failed, failed[:3]
    # the tau bounds decided reached the replicas (Serve's reconfigure with the new user_config), by their own
    # gauge from 5 s after the first decision (tau 1; the cluster started at 4) on: 1, then 4 once widened
    first = run.wall_start + run.evaluations[0].t_s + 5
    assert run.evaluations[0].decision.tau_max == 1
    tau_in_force = set(prometheus.series(f'max(dmtd_tau_max{{deployment="{NAME}"}})', first, time.time()))
    assert {1.0, 4.0} <= tau_in_force, tau_in_force
    figures = {"requests": len(run.results), "slo_attainment": round(run.slo_attainment(plan), 3),
               "replica_s": round(run.replica_s(plan.duration_s), 1), "tau_max_in_force": sorted(tau_in_force),
               "running_replica_s": round(sum(n * 2 for _, n in run.running), 1),
               "decisions": [(round(e.t_s), e.decision.replicas, e.decision.tau_max,
                              None if e.window is None else round(e.window.requests_s, 2),
                              None if e.window is None or e.window.ttft_p95_ms is None
                              else round(e.window.ttft_p95_ms)) for e in run.evaluations],
               "predicted": predicted}
    print("burst:", json.dumps(figures))
