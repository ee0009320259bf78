"""The head pod lost under load (the shared cluster of conftest.py, GCS fault tolerance as the operator renders it:
the GCS's tables in an external Redis, taken from the rendered ``gcsFaultToleranceOptions``): closed-loop gRPC
clients on each ingress pod's gateway from before the head's container is killed until 30 s after its new one is
ready. What a client sees: nothing (zero failed requests, counted by the ingress pod they entered through); the
replicas and gateways are the same processes after; the operator's decision submitted while the head is down fails
at once (KubeRay's PUT to the head's dashboard: nothing answers) and succeeds once it is back; Serve's controller
comes back by itself on the new head (Ray restarts it) with the app as it was, and the registry is untouched.

docs/operations.md, "What survives what", has the figures."""

from __future__ import annotations

import asyncio
import time
import urllib.error
from typing import Any

import redis

from dmtd_contract.registry import RegistryClient
from dmtd_operator import render
from tests.cluster import kuberay
from tests.cluster.cluster import RayCluster
from tests.cluster.conftest import render_target
from tests.cluster.load import ClosedLoop, StreamResult
from tests.cluster.redis_proc import RedisProcess

DOWN_S = 3.0  # the head's container stays dead this long before KubeRay's new one starts
AFTER_S = 30.0  # load goes on this long after the new head is ready
CLIENTS_PER_ENTRY = 2


def processes(cluster: RayCluster) -> dict[str, tuple[str, int, str]]:
    """Every RUNNING replica of the app: replica id → (deployment, pid, node address)."""
    return {r["replica_id"]: (dep, r["pid"], r["node_ip"]) for dep in ("DMTDReplica", "Gateway")
            for r in cluster.running_replicas(dep)}


def deployed_user_config(cluster: RayCluster) -> Any:
    return cluster.serve_details()["applications"]["dmtd"]["deployments"]["DMTDReplica"]["deployment_config"].get(
        "user_config")


def timed_submit(cluster: RayCluster, config: dict[str, Any]) -> tuple[float, str | None]:
    """KubeRay's PUT of a serve config: its seconds and its error (None when it was accepted)."""
    t0 = time.monotonic()
    try:
        cluster.submit(config)
        return time.monotonic() - t0, None
    except (OSError, RuntimeError) as e:  # URLError is an OSError: nothing answered
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        return time.monotonic() - t0, f"{type(e).__name__}: {reason}"


def test_head_killed_under_load_fails_no_request_through_the_ingress_pods(cluster: RayCluster,
                                                                           registry: RedisProcess,
                                                                           gcs_redis: RedisProcess) -> None:
    assert "RAY_REDIS_ADDRESS" in cluster.head.spec.env  # from the rendered gcsFaultToleranceOptions
    cluster.wait_app("dmtd", 120, {"Gateway": len(cluster.ingress)})
    replicas = len(cluster.running_replicas("DMTDReplica"))
    before = processes(cluster)
    config_before = cluster.serve_details()["applications"]["dmtd"]["deployed_app_config"]
    with RegistryClient(registry.url) as reg:
        registry_before = sorted(e.model_dump_json() for e in reg.list())
    # the operator's next decision, tau 4 -> 3 (a user_config change, applied in place by Serve's reconfigure)
    decision = kuberay.serve_config(render.ray_service(render_target(registry.url, replicas=replicas, tau_max=3)))
    marks: dict[str, float] = {}

    async def run() -> tuple[dict[str, list[StreamResult]], tuple[float, str | None], tuple[float, str | None]]:
        loops = {g: ClosedLoop(g, clients=CLIENTS_PER_ENTRY, max_new_tokens=12).start() for g in cluster.gateways()}
        await asyncio.sleep(3)
        await asyncio.to_thread(cluster.head.kill)
        marks["kill"] = time.monotonic()
        during = await asyncio.to_thread(timed_submit, cluster, decision)
        await asyncio.sleep(max(0.0, DOWN_S - (time.monotonic() - marks["kill"])))
        marks["restart"] = time.monotonic()
        await asyncio.to_thread(cluster.restart_head)
        marks["back"] = time.monotonic()
        await asyncio.to_thread(cluster.wait_nodes, len(cluster.nodes), 120)
        marks["nodes"] = time.monotonic()
        await asyncio.to_thread(cluster.wait_app, "dmtd", 120)
        marks["serve"] = time.monotonic()
        after = await asyncio.to_thread(timed_submit, cluster, decision)
        await asyncio.sleep(max(0.0, AFTER_S - (time.monotonic() - marks["back"])))
        return {g: await loop.stop() for g, loop in loops.items()}, during, after

    by_entry, during, after = asyncio.run(run())
    failed = {g: [(r.code, r.detail) for r in res if not r.ok or r.tokens != r.expected_tokens]
              for g, res in by_entry.items()}
    outage = {g: [r for r in res if r.started >= marks["kill"] and r.ended <= marks["back"]]
              for g, res in by_entry.items()}
    counts = {g: (len(res), len(outage[g]), len(failed[g])) for g, res in by_entry.items()}
    print(f"head loss: down {marks['back'] - marks['kill']:.1f} s (new head ready "
          f"{marks['back'] - marks['restart']:.1f} s after its start; all nodes alive "
          f"+{marks['nodes'] - marks['back']:.1f} s, Serve's app RUNNING +{marks['serve'] - marks['back']:.1f} s); "
          f"requests by entry (all, within the outage, failed): {counts}; the decision during the outage: {during}; "
          f"after: {after[0]:.2f} s")
    assert all(f == [] for f in failed.values()), failed
    assert all(len(res) >= 10 and outage[g] for g, res in by_entry.items()), {g: len(r) for g, r in outage.items()}
    assert processes(cluster) == before  # the same replica and gateway processes, on the same nodes
    assert len(cluster.alive_nodes()) == len(cluster.nodes)
    # the control plane lives on the head: the decision's PUT fails at once, and goes through once the head is back
    assert during[1] is not None and during[0] < 10, during
    assert after[1] is None and after[0] < 30, after
    assert deployed_user_config(cluster) == {"tau_min": 1, "tau_max": 3}
    # Serve recovered the app from the GCS's Redis: the config KubeRay had submitted, without a resubmission
    assert {k: v for k, v in config_before.items() if k != "deployments"} == {
        k: v for k, v in cluster.serve_details()["applications"]["dmtd"]["deployed_app_config"].items()
        if k != "deployments"}
    with RegistryClient(registry.url) as reg:
        assert sorted(e.model_dump_json() for e in reg.list()) == registry_before
    with redis.Redis.from_url(gcs_redis.url) as r:
        assert r.dbsize() > 0  # the GCS's tables, which the new head read back
