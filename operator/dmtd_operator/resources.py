"""Names shared by the CRD, the operator, the chart and the tests."""

from __future__ import annotations

GROUP = "serving.dmtd.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DMTDDeployment"
PLURAL = "dmtddeployments"
SINGULAR = "dmtddeployment"
SHORT_NAMES = ("dmtd",)
CRD_NAME = f"{PLURAL}.{GROUP}"

RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_API_VERSION = f"{RAY_GROUP}/{RAY_VERSION}"
RAY_SERVICE_KIND = "RayService"
RAY_SERVICE_PLURAL = "rayservices"

SERVE_APP_NAME = "dmtd"
SERVE_IMPORT_PATH = "dmtd.serve.app:build_app"
REPLICA_DEPLOYMENT = "DMTDReplica"
GATEWAY_DEPLOYMENT = "Gateway"
GATEWAY_GRPC_PORT = 9000
"""The Gateway deployment's gRPC port (dmtd.v1.GenerateService, health, reflection)."""
GATEWAY_HTTP_PORT = 8001
"""The Gateway deployment's own HTTP server (the OpenAI API, the dashboard); Serve's proxy keeps SERVE_HTTP_PORT."""
GATEWAY_RESOURCE = "dmtd-gateway"
"""Custom Ray resource only the ingress pods offer (one each): one Gateway replica per ingress pod, none elsewhere."""
INGRESS_GROUP = "ingress"
"""The RayCluster worker group of the ingress pods (KubeRay labels them ``ray.io/group: ingress``)."""
SERVE_HTTP_PORT = 8000
METRICS_PORT = 9464
"""Where serving pods expose the dmtd_* metrics (the OpenTelemetry Prometheus exporter's default)."""
DRAIN_FILE = "/tmp/dmtd-drain"
"""The file an ingress pod's gateway watches (env DMTD_DRAIN_FILE): its preStop creates it (dmtd.serve.pod_drain)."""
DRAIN_DELAY_S = 8
"""How long a draining gateway on an ingress pod still takes new calls, already not ready (env DMTD_DRAIN_DELAY_S),
so that the gateway Service sends it no client it would refuse: its readiness probe's period (2 s), and in Serve's
rolling update the warm-up of the new gateway that started just before (Serve stops the next old one as soon as the
new one's constructor returns; it is ready once a request has gone through it)."""
POD_GRACE_S = 90
"""terminationGracePeriodSeconds of the worker and ingress pods: the preStop's drain, then Ray's own stop."""
PRE_STOP_TIMEOUT_S = 75
"""How long the preStop waits for the pod's streams (the gateway's own grace for them is 30 s: DMTD_DRAIN_GRACE_S)."""

LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_INSTANCE = f"{GROUP}/deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "dmtd-operator"

ANNOTATION_METRICS_WINDOW = f"metrics.{GROUP}/window"
"""JSON metrics window read by the `annotation` metrics source (tests, manual overrides)."""

FINALIZER = f"{GROUP}/cleanup"


def ray_service_name(name: str) -> str:
    """Name of the RayService owned by DMTDDeployment `name`."""
    return f"{name}-ray"


def gateway_service_name(name: str) -> str:
    """Name of the gateway Service owned by DMTDDeployment `name`."""
    return f"{name}-gateway"


def metrics_service_name(name: str) -> str:
    """Name of the headless Service the ServiceMonitor scrapes for DMTDDeployment `name`."""
    return f"{name}-metrics"


def registry_configmap_name(name: str) -> str:
    """Name of the ConfigMap mirroring the registry entries of DMTDDeployment `name`."""
    return f"{name}-registry"


def child_labels(name: str, component: str) -> dict[str, str]:
    """Labels put on every object the operator creates for DMTDDeployment `name`."""
    return {
        LABEL_PART_OF: "dmtd",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
    }
