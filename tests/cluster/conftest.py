"""One Ray cluster from the operator's RayService, shared by the tests of this package that use it (package-scoped:
torn down before `make test` goes on to other packages; pytest_collection_modifyitems runs them last, in the
order test_cluster.py, test_head_loss.py, test_upgrade.py): podman containers on a bridge network inside this
process's private network namespace; the registry's Redis and the GCS's (spec.serving.gcsFaultTolerance, a
separate instance, so that the registry's restart test leaves the GCS alone) on the bridge's host side."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from dmtd.serve.netns import isolate_network
from dmtd_operator import render
from dmtd_operator import resources as r
from dmtd_operator.spec import DMTDDeploymentSpec
from tests.cluster import kuberay
from tests.cluster.cluster import PodNetwork, RayCluster
from tests.cluster.prom import PrometheusProcess, scrape_config
from tests.cluster.redis_proc import RedisProcess
from tests.images.podman import image_missing, image_name, podman_unavailable

NAME, NAMESPACE = "smollm2", "dmtd"
REDIS_PORT = 6390
GCS_REDIS_PORT = 6391
PROMETHEUS_PORT = 9090
# The chart's default DMTDDeployment (helm/dmtd/values.yaml), sized for this 2-core machine: CPU replicas.
SPEC: dict[str, Any] = {
    "variants": [{"name": "smollm2-dmtd", "modelUri": "registry://smollm2-135m-dmtd", "weight": 100}],
    "replicas": {"min": 1, "max": 2},
    "resources": {"gpusPerReplica": 0},
    "slo": {"ttftP95Ms": 1000, "itlP95Ms": 50},
    "tau": {"min": 1, "baseline": 1, "max": 4},
    "serving": {"headCpu": "1", "headMemory": "3Gi", "workerCpu": "1", "workerMemory": "6Gi",
                "ingressReplicas": 2, "ingressCpu": "500m", "ingressMemory": "2Gi"},
}


def render_target(registry_url: str, replicas: int = 1, tau_max: int = 4,
                  spec: dict[str, Any] | None = None) -> render.Target:
    """The operator's render target for ``spec`` (SPEC), its GCS in the Redis beside the registry's."""
    body = json.loads(json.dumps(spec or SPEC))
    host = urlsplit(registry_url).hostname
    body["serving"]["gcsFaultTolerance"] = {"redisAddress": f"{host}:{GCS_REDIS_PORT}"}
    return render.Target(NAME, NAMESPACE, DMTDDeploymentSpec.model_validate(body), replicas, 1, tau_max, registry_url)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This package's tests that use the shared cluster after the ones that do not (stable within each), so that
    the cluster is up only while its own tests run."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.path)).parents]
    ours = [items[i] for i in slots]
    ours.sort(key=lambda item: "cluster" in getattr(item, "fixturenames", ()))
    for i, item in zip(slots, ours, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def serving_image() -> str:
    reason = podman_unavailable() or image_missing(image_name("serving"))
    if reason is not None:
        pytest.skip(reason)
    return image_name("serving")


@pytest.fixture(scope="session")
def network(serving_image: str) -> Iterator[PodNetwork]:
    isolate_network()
    # netavark makes the bridge when the first container joins it; servers of this namespace (Redis, Prometheus)
    # bind its gateway address before that
    subprocess.run(["sysctl", "-qw", "net.ipv4.ip_nonlocal_bind=1"], check=True)
    PodNetwork.remove_stale("dmtd-cluster-")
    net = PodNetwork(f"dmtd-cluster-{os.getpid()}", f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}").create()
    yield net
    net.remove()


@pytest.fixture(scope="package")
def registry(network: PodNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    proc = RedisProcess(network.gateway, REDIS_PORT, tmp_path_factory.mktemp("redis")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="package")
def gcs_redis(network: PodNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    proc = RedisProcess(network.gateway, GCS_REDIS_PORT, tmp_path_factory.mktemp("gcs-redis")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="package")
def cluster(network: PodNetwork, registry: RedisProcess, gcs_redis: RedisProcess) -> Iterator[RayCluster]:
    rs = render.ray_service(render_target(registry.url))
    c = RayCluster(rs, network, num_workers=2, prefix=network.name)
    try:
        c.start_s = c.start()
        registry.wait()
        gcs_redis.wait()
        c.submit(kuberay.serve_config(rs))
        c.deploy_s = c.wait_app("dmtd", 300, {"DMTDReplica": 1, "Gateway": len(c.ingress)})
        yield c
    except BaseException:
        for n in c.nodes:
            print(f"--- {n.spec.name}\n{n.logs(30)}\n{n.ray_logs()}")
        raise
    finally:
        c.remove()


@pytest.fixture(scope="module")
def prometheus(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusProcess]:
    """Scrapes every serving pod's metrics port every 2 s, as the chart's ServiceMonitor scrapes the
    `<name>-metrics` Service (one endpoint per pod)."""
    targets = [f"{n.ip}:{r.METRICS_PORT}" for n in cluster.nodes]
    proc = PrometheusProcess(cluster.network.gateway, PROMETHEUS_PORT, tmp_path_factory.mktemp("prometheus"),
                             scrape_config(NAMESPACE, NAME, targets, interval_s=2)).start()
    try:
        # a worker pod exports metrics only while a replica runs on it, an ingress pod its gateway's; the head none
        proc.wait_targets_up(len(cluster.ingress) + len(cluster.running_replicas("DMTDReplica")), timeout_s=30)
        yield proc
    finally:
        proc.stop()
