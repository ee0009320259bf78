"""What the chart renders for the images: the operator Deployment and the default DMTDDeployment."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import yaml

from tests.images.podman import CHART, ROOT


def render_default() -> list[dict[str, Any]] | None:
    """`helm template` of the chart with its default values; None without helm."""
    helm = shutil.which("helm", path=str(ROOT / ".venv" / "bin")) or shutil.which("helm")
    if helm is None:
        return None
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "dmtd"], capture_output=True,
                         text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("operator")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dict(container)


def default_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cr,) = [d for d in docs if d["kind"] == "DMTDDeployment"]
    return dict(cr)


def create_in(k8s: Any, cr: dict[str, Any], path: str) -> dict[str, Any]:
    """POST the chart's DMTDDeployment into the `default` namespace of kmock (`path` its collection); the
    RayService the operator renders for it, once there."""
    body = dict(cr, metadata={**cr["metadata"], "namespace": "default", "uid": "uid-smollm2",
                              "resourceVersion": "1", "generation": 1})
    assert k8s.request("POST", path, body)[0] in (200, 201)
    name = cr["metadata"]["name"]
    return dict(k8s.wait_for(lambda: k8s.objects("ray.io/v1/rayservices").get(f"{name}-ray"), timeout_s=90))


def variants_active(url: str, cr: dict[str, Any]) -> bool:
    """Whether the operator has activated every variant of ``cr`` in the registry at ``url``."""
    from dmtd_contract.registry import RegistryClient

    with RegistryClient(url) as reg:
        return all(reg.get(v["name"]).status == "active" for v in cr["spec"]["variants"])
