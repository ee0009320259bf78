"""Sample DMTDDeployment objects shared by the operator tests."""

from __future__ import annotations

from typing import Any

DMTD = "serving.dmtd.dev/v1alpha1/dmtddeployments"
DMTD_PATH = "/apis/serving.dmtd.dev/v1alpha1/namespaces/default/dmtddeployments"


DMTD = "serving.dmtd.dev/v1alpha1/dmtddeployments"
DMTD_PATH = "/apis/serving.dmtd.dev/v1alpha1/namespaces/default/dmtddeployments"


def sample_cr(name: str = "demo", **spec: Any) -> dict[str, Any]:
    """A valid DMTDDeployment; keyword arguments replace top-level spec sections."""
    body: dict[str, Any] = {
        "variants": [{"name": "smollm2-dmtd", "modelUri": "hf://dmtd/smollm2-135m-dmtd", "weight": 100}],
        "replicas": {"min": 2, "max": 6},
        "resources": {"gpusPerReplica": 1, "gpuType": "NVIDIA-H100-80GB-HBM3"},
        "slo": {"ttftP95Ms": 1000, "itlP95Ms": 50},
        "scaling": {"intervalS": 1, "scaleUpWindowS": 0, "coldStartS": 60},
    }
    body.update(spec)
    return {
        "apiVersion": "serving.dmtd.dev/v1alpha1",
        "kind": "DMTDDeployment",
        # Fields a real API server assigns; kmock stores objects as given.
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "generation": 1,
        },
        "spec": body,
    }
