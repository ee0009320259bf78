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
