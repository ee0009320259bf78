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
    head_args = shlex.split(head.command)  # what bash makes of the line KubeRay writes
    assert head_args[:3] == ["ray", "start", "--head"] and "--block" in head_args
    assert "--num-cpus=0" in head_args and "--num-gpus=0" in head_args and "--dashboard-host=0.0.0.0" in head_args
    (resources,) = [a for a in head_args if a.startswith("--resources=")]
    assert resources == '--resources={"' + r.GATEWAY_RESOURCE + '": 1}'  # the shell unquoted KubeRay's JSON string
    worker_args = shlex.split(worker.command)
    assert "--head" not in worker_args and "--address=10.0.0.10:6379" in worker_args
    assert "--num-cpus=1" in worker_args and f"--memory={6 * 2**30}" in worker_args  # memory from the limit
    assert worker.env["DMTD_TORCH_THREADS"] == "1" and worker.env["RAY_timeout_ms_task_wait_for_death_info"] == "0"
    assert head.env["RAY_ADDRESS"] == "127.0.0.1:6379" and worker.env["RAY_ADDRESS"] == "10.0.0.10:6379"
    assert head.env["DMTD_REGISTRY_URL"] == "redis://10.0.0.1:6390/0"
    params = kuberay.start_params(rs["spec"]["rayClusterConfig"]["headGroupSpec"], "head", "10.0.0.10")
    assert kuberay.resources_flag(params) == {r.GATEWAY_RESOURCE: 1}


def test_quantities_read_as_kubernetes_reads_them() -> None:
    assert kuberay.quantity("500m") == 0.5 and kuberay.quantity("6Gi") == 6 * 2**30
    assert kuberay.quantity("1G") == 10**9 and kuberay.quantity("2") == 2
