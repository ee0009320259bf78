"""A new variant version rolled out under load (the shared cluster of conftest.py): the DMTDDeployment's variant
points at a new model URI; the operator renders it and KubeRay submits the serve config to the running cluster.

Which mechanism: Serve's rolling update, not RayService's switch-over. KubeRay starts a new RayCluster (and
switches its Services over once it serves) only when ``rayClusterConfig`` changes — a new serving image; a change
of ``serveConfigV2`` alone goes to the running cluster. There a change of the app's ``args`` (the variants are
args) is a new code version of *every* deployment of the app (Serve's get_app_code_version hashes the import path,
runtime env and args), so Serve replaces the replicas and the gateways, one of each at a time (20 % of the target,
at least one; the next only once the new one runs), each old one drained first (graceful shutdown: its streams
in flight finish; a gateway goes not-ready, sends GOAWAY and refuses new calls). With two of each, one keeps
serving while the other is replaced. The clients know one address, the gateway Service's (service.py: kube-proxy's
pick among the ready ingress pods): a gateway being replaced says not ready at once but takes new calls for
DMTD_DRAIN_DELAY_S (8 s) more, until its probe has taken it out of the Service and the new gateway Serve started
just before (the roll goes on once its constructor returns) is warm and ready, so the Service always has a gateway
that takes calls.

Asserted: zero failed requests and no connection refused (a closed loop of short requests, and long streams started
before the submit, each run to its length), every replica and gateway afterwards a new process, requests after the
roll served by the new replicas, the new model in the app's config.

A new serving image is the other mechanism, KubeRay's switch-over to a second RayCluster (the second test): the old
cluster's pods drain in their preStop (dmtd.serve.pod_drain) before their SIGTERM."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from typing import Any

from dmtd.client import AsyncDMTDClient
from dmtd_operator import render
from tests.cluster import kuberay
from tests.cluster.cluster import RayCluster, RayNode, podman
from tests.cluster.conftest import SPEC, render_target
from tests.cluster.load import ClosedLoop, StreamResult, balanced, stream
from tests.cluster.redis_proc import RedisProcess
from tests.cluster.service import ServiceProxy

LONG_STREAMS, LONG_TOKENS = 6, 96
OLD_STREAMS = 4  # in flight on the old cluster when the switch-over deletes it


def replica_names(cluster: RayCluster) -> set[str]:
    """``TokenBlock.replica`` of each RUNNING replica ("replica-<host>-<pid>")."""
    return {f"replica-{cluster.node_of(r['node_ip']).spec.name}-{r['pid']}"
            for r in cluster.running_replicas("DMTDReplica")}


def wait_all_new(cluster: RayCluster, old_ids: set[str], count: int, timeout_s: float) -> float:
    """Seconds until ``count`` replicas run and none of ``old_ids`` is listed any more."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        reps = cluster.replicas("DMTDReplica")
        running = [r for r in reps if r["state"] == "RUNNING"]
        if len(running) == count and not any(r["replica_id"] in old_ids for r in reps):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"old replicas still listed after {timeout_s} s: {cluster.replicas('DMTDReplica')}")


def wait_gateways_replaced(cluster: RayCluster, old: set[tuple[str, int]], count: int, timeout_s: float) -> None:
    """Until ``count`` gateways run, none of them in ``old`` (replica id, pid)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {(r["replica_id"], r["pid"]) for r in cluster.running_replicas("Gateway")}
        if len(now) == count and now.isdisjoint(old):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"gateways not replaced in {timeout_s} s: {now} (old {old})")
        time.sleep(0.5)


def test_a_new_variant_version_rolls_replica_by_replica_under_streams(cluster: RayCluster,
                                                                      registry: RedisProcess) -> None:
    if len(cluster.running_replicas("DMTDReplica")) != 2:
        cluster.submit(kuberay.serve_config(render.ray_service(render_target(registry.url, replicas=2))))
        cluster.wait_app("dmtd", 240, {"DMTDReplica": 2})
    old_ids = {r["replica_id"] for r in cluster.running_replicas("DMTDReplica")}
    old_names = replica_names(cluster)
    gateways = {(r["replica_id"], r["pid"]) for r in cluster.running_replicas("Gateway")}
    svc = ServiceProxy().start()  # the clients know one address: the gateway Service's
    svc.add(*(n.ip for n in cluster.ingress))
    svc.wait_ready({n.ip for n in cluster.ingress}, 30)
    spec = copy.deepcopy(SPEC)
    spec["variants"][0]["modelUri"] = "smollm2"  # v2: the embedded model itself (was the shipped variant)
    new_config = kuberay.serve_config(render.ray_service(render_target(registry.url, replicas=2, spec=spec)))
    marks: dict[str, float] = {}

    async def run() -> tuple[list[StreamResult], list[StreamResult]]:
        loop = ClosedLoop(svc.target, clients=2, max_new_tokens=12).start()
        async with AsyncDMTDClient(svc.target, timeout_s=300) as client:
            firsts = [asyncio.Event() for _ in range(LONG_STREAMS)]
            tasks = [asyncio.create_task(stream(client, 300 + i, LONG_TOKENS, firsts[i]))
                     for i in range(LONG_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 180)
            marks["submit"] = time.monotonic()
            await asyncio.to_thread(cluster.submit, new_config)
            long = list(await asyncio.gather(*tasks))
        await asyncio.to_thread(wait_all_new, cluster, old_ids, 2, 300)
        await asyncio.to_thread(wait_gateways_replaced, cluster, gateways, 2, 120)
        marks["rolled"] = time.monotonic()
        await asyncio.sleep(5)
        return await loop.stop(), long

    try:
        short, long = asyncio.run(run())
    finally:
        svc.stop()
    new_names = replica_names(cluster)
    failed = [(r.code, r.detail) for r in [*short, *long] if not r.ok or r.tokens != r.expected_tokens]
    after = [r for r in short if r.started >= marks["rolled"]]
    print(f"variant v2 rolled in {marks['rolled'] - marks['submit']:.1f} s under load: {len(short)} short requests, "
          f"{len(long)} long streams ({sum(r.replica in old_names for r in long)} on old replicas), "
          f"{len(failed)} failed, {svc.refused} connections refused; {len(after)} requests after the roll; "
          f"connections by pod {svc.connections}")
    assert failed == [] and svc.refused == 0, failed[:5]
    assert {r.replica for r in long} <= old_names  # they began on the old replicas and finished there
    assert new_names.isdisjoint(old_names) and len(new_names) == 2
    assert after and {r.replica for r in after} <= new_names
    assert {(r["replica_id"], r["pid"]) for r in cluster.running_replicas("Gateway")}.isdisjoint(gateways)
    app = cluster.serve_details()["applications"]["dmtd"]["deployed_app_config"]
    assert app["args"]["variants"][0]["model"] == "smollm2"


def hook_result(out: str) -> dict[str, Any]:
    """The preStop's JSON line (dmtd.serve.pod_drain), or what it wrote instead."""
    try:
        return dict(json.loads(out.splitlines()[-1]))
    except (IndexError, ValueError):
        return {"error": out}


def test_a_new_serving_image_switches_over_to_a_new_cluster_under_streams(cluster: RayCluster, registry: RedisProcess,
                                                                          serving_image: str) -> None:
    """KubeRay's switch-over (a new ``serving.image`` changes ``rayClusterConfig``): a second RayCluster from the new
    pod templates, its Serve config submitted, its ingress pods joining the gateway Service once warm (their
    readiness probe), then the old RayCluster deleted — each old pod's preStop (dmtd.serve.pod_drain: the gateway
    drains, the pod waits until nothing is in flight), then SIGTERM. KubeRay waits 60 s between the switch and the
    deletion (RayClusterDeletionDelaySeconds); here the deletion follows at once, which only shortens the overlap.

    Clients know one address, the Service's (tests/cluster/service.py: kube-proxy's choice among ready endpoints):
    a closed loop throughout, and long streams whose connections the Service had placed on the old ingress pods,
    in flight when the old cluster is deleted. Asserted: zero failed requests, no connection refused, the long
    streams whole and on old replicas, each old gateway drained with its streams and none cut, the old pods quiet
    before their SIGTERM, and the requests after served by the new cluster's replicas, from the new image."""
    new_image = serving_image.rsplit(":", 1)[0] + ":switch-over"  # the same build, a new reference: a new image
    podman("tag", serving_image, new_image)
    spec = copy.deepcopy(SPEC)
    spec["serving"]["image"] = new_image
    spec["variants"][0]["modelUri"] = "smollm2"  # the version in force (the test above rolled it): the image alone
    new_rs = render.ray_service(render_target(registry.url, replicas=1, spec=spec))
    assert new_rs["spec"]["rayClusterConfig"] != cluster.ray_service["spec"]["rayClusterConfig"]  # a new RayCluster
    new = RayCluster(new_rs, cluster.network, num_workers=1, prefix=f"{cluster.network.name}-v2", host_base=100)
    old_names = replica_names(cluster)
    old_ingress = {n.ip for n in cluster.ingress}
    svc = ServiceProxy().start()
    svc.add(*old_ingress)
    svc.wait_ready(old_ingress, 30)
    marks: dict[str, float] = {}
    hooks: dict[str, tuple[float, str]] = {}

    def delete_old_cluster() -> None:
        """Every old pod at once: the endpoints leave the Service, the preStops run (the head has none), and each pod
        gets its SIGTERM after its own; returns once every preStop is done (the SIGTERMs, which no client can see
        any more, go on in the background)."""
        svc.delete(*old_ingress)

        def delete(n: RayNode) -> None:
            hooks[n.spec.name] = n.pre_stop()
            # the package's teardown removes what is still running (Ray in a pod may outwait its SIGTERM)
            threading.Thread(target=n.stop, args=(hooks[n.spec.name][0],), daemon=True).start()

        threads = [threading.Thread(target=delete, args=(n,)) for n in cluster.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)

    async def run() -> tuple[list[StreamResult], list[StreamResult]]:
        loop = ClosedLoop(svc.target, clients=2, max_new_tokens=12).start()
        marks["new"] = time.monotonic()
        await asyncio.to_thread(new.start)
        svc.add(*(n.ip for n in new.ingress))  # the Service's selector matches them; ready once warm
        await asyncio.to_thread(new.submit, kuberay.serve_config(new_rs))
        await asyncio.to_thread(new.wait_app, "dmtd", 300, {"DMTDReplica": 1, "Gateway": len(new.ingress)})
        await asyncio.to_thread(svc.wait_ready, {n.ip for n in new.ingress}, 120)
        marks["switched"] = time.monotonic()
        target, options = balanced(cluster.gateways())
        async with AsyncDMTDClient(target, timeout_s=300, options=options) as client:
            firsts = [asyncio.Event() for _ in range(OLD_STREAMS)]
            tasks = [asyncio.create_task(stream(client, 400 + i, LONG_TOKENS, firsts[i])) for i in range(OLD_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 180)
            marks["delete"] = time.monotonic()
            deleting = asyncio.create_task(asyncio.to_thread(delete_old_cluster))
            long = list(await asyncio.gather(*tasks))
            await deleting
        marks["gone"] = time.monotonic()
        await asyncio.sleep(5)
        return await loop.stop(), long

    try:
        short, long = asyncio.run(run())
        new_names = replica_names(new)
        images = {podman("inspect", "-f", "{{.ImageName}}", n.spec.name) for n in new.nodes}
    finally:
        svc.stop()
        new.remove()
        podman("untag", new_image, check=False)
    failed = [(r.code, r.detail) for r in [*short, *long] if not r.ok or r.tokens != r.expected_tokens]
    after = [r for r in short if r.started >= marks["gone"]]
    gateways = {name: hook_result(out) for name, (_, out) in hooks.items() if "ingress" in name}
    workers = {name: hook_result(out) for name, (_, out) in hooks.items() if "worker" in name}
    print(f"image switch-over: new cluster serving {marks['switched'] - marks['new']:.1f} s after its pods started; "
          f"old cluster drained in {marks['gone'] - marks['delete']:.1f} s (preStops "
          f"{ {n: round(s, 1) for n, (s, _) in hooks.items()} }); {len(short)} requests through the Service, "
          f"{len(long)} long streams on the old gateways, {len(failed)} failed, {svc.refused} connections refused; "
          f"{len(after)} requests after; gateways drained: { {n: g['gateway'] for n, g in gateways.items()} }")
    assert failed == [] and svc.refused == 0, failed[:5]
    assert {r.replica for r in long} <= old_names  # in flight on the old cluster when it was deleted, and whole
    assert len(gateways) == len(cluster.ingress), hooks
    assert all(g.get("quiet") and (g.get("gateway") or {}).get("cut") == 0 for g in gateways.values()), gateways
    assert sum(g["gateway"]["in_flight"] for g in gateways.values()) >= 1, gateways  # the drain had streams to wait for
    assert len(workers) == len(cluster.workers) and all(w["quiet"] for w in workers.values()), workers
    assert after and {r.replica for r in after} <= new_names and len(new_names) == 1
    assert images == {new_image}
