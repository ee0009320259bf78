"""Real-cluster end to end: install the chart, wait for the default deployment, stream one request.

Skipped unless KUBECONFIG points at a cluster (kind works) with KubeRay installed and the two images
loaded. How to run it: docs/operations.md, "End-to-end test on kind".

    DMTD_E2E_OPERATOR_IMAGE=dmtd/operator:dev DMTD_E2E_SERVING_IMAGE=dmtd/serving:dev \
    KUBECONFIG=~/.kube/config .venv/bin/python -m pytest tests/operator/test_e2e_kind.py -v
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from manifests import CHART, ROOT

KUBECONFIG = os.environ.get("KUBECONFIG", "")
HELM = shutil.which("helm", path=str(ROOT / ".venv" / "bin")) or shutil.which("helm")
KUBECTL = shutil.which("kubectl")
NAMESPACE = os.environ.get("DMTD_E2E_NAMESPACE", "dmtd-e2e")
STREAM_CMD = os.environ.get(
    "DMTD_E2E_STREAM_CMD", "dmtd generate --server {target} --prompt Hello --max-new-tokens 8"
)

pytestmark = [
    pytest.mark.skipif(not KUBECONFIG, reason="KUBECONFIG not set: no cluster to test against"),
    pytest.mark.skipif(HELM is None or KUBECTL is None, reason="needs helm and kubectl"),
]


def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert KUBECTL is not None
    return subprocess.run(
        [KUBECTL, "-n", NAMESPACE, *args], capture_output=True, text=True, check=check, timeout=120
    )


def _image(var: str) -> tuple[str, str]:
    ref = os.environ.get(var, "")
    if not ref:
        pytest.skip(f"{var} not set (an image loaded into the cluster)")
    repo, _, tag = ref.rpartition(":")
    return repo, tag


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if kubectl("get", "crd", "rayservices.ray.io", check=False).returncode != 0:
        pytest.skip("KubeRay is not installed in the cluster")
    op_repo, op_tag = _image("DMTD_E2E_OPERATOR_IMAGE")
    serving_repo, serving_tag = _image("DMTD_E2E_SERVING_IMAGE")
    values = tmp_path_factory.mktemp("e2e") / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "operator": {
                    "image": {"repository": op_repo, "tag": op_tag, "pullPolicy": "Never"},
                    "metricsSource": "none",
                    "watchNamespaces": [NAMESPACE],
                },
                "redis": {"persistence": {"enabled": False}},
                "serviceMonitor": {"enabled": False},
                "defaultDeployment": {
                    "spec": {
                        "variants": [
                            {
                                "name": "smollm2-dmtd",
                                "modelUri": "registry://smollm2-135m-dmtd",
                                "weight": 100,
                            }
                        ],
                        "replicas": {"min": 1, "max": 1},
                        "resources": {"gpusPerReplica": 0},
                        "serving": {
                            "image": f"{serving_repo}:{serving_tag}",
                            "headCpu": "1",
                            "headMemory": "3Gi",
                            "workerCpu": "1",
                            "workerMemory": "3Gi",
                            "ingressReplicas": 1,
                            "ingressCpu": "500m",
                            "ingressMemory": "2Gi",
                        },
                    }
                },
            }
        )
    )
    assert HELM is not None
    subprocess.run(
        [
            HELM,
            "upgrade",
            "--install",
            "e2e",
            str(CHART),
            "-n",
            NAMESPACE,
            "--create-namespace",
            "-f",
            str(values),
            "--wait",
            "--timeout",
            "5m",
        ],
        check=True,
        timeout=400,
    )
    try:
        yield "e2e"
    finally:
        kubectl("delete", "dmtddeployments", "--all", "--wait=true", "--timeout=300s", check=False)
        subprocess.run([HELM, "uninstall", "e2e", "-n", NAMESPACE], check=False, timeout=300)


def _ready(name: str) -> bool:
    res = kubectl("get", "dmtddeployment", name, "-o", "json", check=False)
    if res.returncode != 0:
        return False
    conditions = json.loads(res.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_chart_installs_and_streams_one_request(release: str, tmp_path: Path) -> None:
    assert kubectl("get", "rayservice", "smollm2-ray").returncode == 0
    deadline = time.monotonic() + 900
    while not _ready("smollm2"):
        assert time.monotonic() < deadline, kubectl("get", "dmtddeployment", "smollm2", "-o", "yaml").stdout
        time.sleep(10)
    port = _free_port()
    assert KUBECTL is not None
    forward = subprocess.Popen(
        [KUBECTL, "-n", NAMESPACE, "port-forward", "svc/e2e-dmtd-gateway", f"{port}:9000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        time.sleep(3)
        cmd = shlex.split(STREAM_CMD.format(target=f"127.0.0.1:{port}"))
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        forward.terminate()
        forward.wait(10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the stream produced no text"
