"""The KubeRay side of the harness on the operator's RayService, without containers: the `ray start` lines and the
environment KubeRay would give the head and the workers."""

from __future__ import annotations

import shlex

from dmtd_operator import render
from dmtd_operator import resources as r
from tests.cluster import kuberay
from tests.cluster.conftest import render_target


def test_head_and_worker_start_lines_carry_the_rendered_resources() -> None:
    rs = render.ray_service(render_target("redis://10.0.0.1:6390/0"))
    head = kuberay.node_spec(rs, "head", "h", "10.0.0.10")
    worker = kuberay.node_spec(rs, "worker", "w", "10.0.0.10")
    ingress = kuberay.node_spec(rs, "worker", "i", "10.0.0.10", group_name="ingress")
    head_args = shlex.split(head.command)  # what bash makes of the line KubeRay writes
    assert head_args[:3] == ["ray", "start", "--head"] and "--block" in head_args
    assert "--num-cpus=0" in head_args and "--num-gpus=0" in head_args and "--dashboard-host=0.0.0.0" in head_args
    assert not [a for a in head_args if a.startswith("--resources=")]  # no gateway on the head
    ingress_args = shlex.split(ingress.command)
    (resources,) = [a for a in ingress_args if a.startswith("--resources=")]
    assert resources == '--resources={"' + r.GATEWAY_RESOURCE + '": 1}'  # the shell unquoted KubeRay's JSON string
    assert "--num-cpus=0" in ingress_args and ingress.group == "ingress" and "DMTD_TORCH_THREADS" not in ingress.env
    worker_args = shlex.split(worker.command)
    assert "--head" not in worker_args and "--address=10.0.0.10:6379" in worker_args
    assert "--num-cpus=1" in worker_args and f"--memory={6 * 2**30}" in worker_args  # memory from the limit
    assert worker.env["DMTD_TORCH_THREADS"] == "1" and worker.env["RAY_timeout_ms_task_wait_for_death_info"] == "0"
    assert head.env["RAY_ADDRESS"] == "127.0.0.1:6379" and worker.env["RAY_ADDRESS"] == "10.0.0.10:6379"
    assert head.env["DMTD_REGISTRY_URL"] == "redis://10.0.0.1:6390/0"
    params = kuberay.start_params(kuberay.worker_group(rs, "ingress"), "worker", "10.0.0.10")
    assert kuberay.resources_flag(params) == {r.GATEWAY_RESOURCE: 1}


def test_gcs_fault_tolerance_env_comes_from_the_rendered_options() -> None:
    """KubeRay's configureGCSFaultTolerance, applied to the operator's gcsFaultToleranceOptions: the head's GCS
    writes to that Redis under the RayCluster's own prefix; the workers outwait a restarting head."""
    rs = render.ray_service(render_target("redis://10.0.0.1:6390/0"))
    assert rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {"redisAddress": "10.0.0.1:6391"}
    head = kuberay.node_spec(rs, "head", "h", "10.0.0.10", storage_namespace="uid-1")
    worker = kuberay.node_spec(rs, "worker", "w", "10.0.0.10")
    assert head.env["RAY_REDIS_ADDRESS"] == "10.0.0.1:6391" and head.env["RAY_external_storage_namespace"] == "uid-1"
    assert "RAY_REDIS_ADDRESS" not in worker.env and worker.env["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
    rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisPassword"] = {
        "valueFrom": {"secretKeyRef": {"name": "gcs", "key": "pw"}}}
    head = kuberay.node_spec(rs, "head", "h", "10.0.0.10", secrets={("gcs", "pw"): "s3cret"})
    assert head.env["REDIS_PASSWORD"] == "s3cret"
    del rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert "RAY_REDIS_ADDRESS" not in kuberay.node_spec(rs, "head", "h", "10.0.0.10").env


def test_quantities_read_as_kubernetes_reads_them() -> None:
    assert kuberay.quantity("500m") == 0.5 and kuberay.quantity("6Gi") == 6 * 2**30
    assert kuberay.quantity("1G") == 10**9 and kuberay.quantity("2") == 2
