"""The operator image: it can import everything its default configuration reaches, and, started the way
the chart starts it, reconciles a DMTDDeployment against kmock and publishes into a real redis-server.

Everything runs on the loopback of a private network namespace; the container joins it (--network host).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dmtd_contract.registry import RegistryClient, VariantSpec
from tests.images.chart import create_in, default_deployment, operator_container, render_default, variants_active
from tests.images.podman import Container, run_in
from tests.operator.dmtd_samples import DMTD_PATH
from tests.operator.kube_emulator import KubeEmulator
from tests.registry.conftest import redis_server  # noqa: F401 — the session redis-server fixture

HERE = Path(__file__).resolve().parent
FORBIDDEN = ["torch", "ray", "dmtd", "transformers", "grpc"]


def import_report(image: str, entries: list[str], extra_path: Path | None = None) -> dict[str, Any]:
    """tests/images/import_check.py run inside `image` on `entries` (an extra directory on its path)."""
    args = ["-v", f"{HERE / 'import_check.py'}:/check.py:ro", "--entrypoint", "python3"]
    if extra_path is not None:
        extra_path.chmod(0o755)  # the image runs as an unprivileged user
        args += ["-v", f"{extra_path}:/probe:ro", "-e", "PYTHONPATH=/app:/probe"]
    out = run_in(image, args, ["/check.py", *entries, "--forbid", *FORBIDDEN])
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_image_imports_all_its_default_configuration_reaches(operator_image: str, tmp_path: Path) -> None:
    report = import_report(operator_image, ["dmtd_operator.handlers"])
    # The chart's default registryWriter (redis) needs the contract's registry client and redis.
    assert {"dmtd_operator.registry", "dmtd_contract.registry.client", "redis", "kopf"} <= set(report["modules"])
    assert report["failed"] == {}, f"the operator image cannot import: {report['failed']}"
    assert report["forbidden_loaded"] == []


def test_the_import_check_sees_function_level_imports(operator_image: str, tmp_path: Path) -> None:
    # The operator's old way: the platform's registry imported inside a method, invisible at import time.
    (tmp_path / "probe_lazy_import.py").write_text(
        "def publish():\n    from dmtd.registry import RegistryClient\n    return RegistryClient\n")
    report = import_report(operator_image, ["probe_lazy_import"], tmp_path)
    assert "ModuleNotFoundError" in report["failed"]["dmtd.registry"]


def test_the_image_reconciles_and_publishes_with_the_charts_defaults(
    netns: None, operator_image: str, redis_server: str, tmp_path: Path,  # noqa: F811
) -> None:
    docs = render_default()
    if docs is None:
        pytest.skip("helm is not installed (scripts/install-helm.sh)")
    chart = operator_container(docs)
    env = {e["name"]: e.get("value", "") for e in chart["env"]}
    assert env["DMTD_REGISTRY_WRITER"] == "redis"  # the chart's default, the one under test
    assert chart["image"] == operator_image
    cr = default_deployment(docs)
    url = redis_server.rsplit("/", 1)[0] + "/9"
    for v in cr["spec"]["variants"]:  # a variant's owner registers it; the operator activates and weighs it
        with RegistryClient(url) as reg:
            reg.register(VariantSpec.model_validate({"name": v["name"], "num_thinking_layers": 22,
                                                     "num_decoding_layers": 8, "tau_max": 4}))
    env |= {"DMTD_REGISTRY_URL": url, "DMTD_METRICS_SOURCE": "none",  # loopback stand-ins for cluster services
            "DMTD_RECONCILE_INTERVAL_S": "1", "KUBECONFIG": "/kube/config"}
    with KubeEmulator() as k8s:
        kube = tmp_path / "kube"
        kube.mkdir(mode=0o755)
        k8s.kubeconfig(kube / "config").chmod(0o644)
        args = ["-v", f"{kube}:/kube:ro", "--read-only", "--tmpfs", "/tmp"]  # readOnlyRootFilesystem, as charted
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        container = Container(operator_image, args, chart["args"]).start()
        try:
            started = time.monotonic()
            rs = create_in(k8s, cr, DMTD_PATH)
            name = cr["metadata"]["name"]
            k8s.wait_for(lambda: variants_active(url, cr), timeout_s=30)
            took = time.monotonic() - started
            mirror = json.loads(k8s.wait_for(lambda: k8s.objects("v1/configmaps").get(f"{name}-registry"))
                                ["data"]["entry.json"])
        except Exception:
            print(container.logs())
            raise
        finally:
            container.stop()
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["image"] == cr["spec"]["serving"]["image"]
    with RegistryClient(url) as reg:
        served = {v["name"]: reg.get(v["name"]) for v in cr["spec"]["variants"]}
    assert {n: e.traffic_weight for n, e in served.items()} == {
        v["name"]: v["weight"] / 100 for v in cr["spec"]["variants"]}
    assert mirror["variants"][0]["name"] == cr["spec"]["variants"][0]["name"]
    assert took < 60
