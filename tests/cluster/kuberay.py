"""What KubeRay does with a RayService's `rayClusterConfig`, as plain functions: the `ray start` command and the
environment of each Ray container, the probes it adds, and the serve config it submits.

Follows KubeRay's own pod builder (ray-operator/controllers/ray/common/pod.go, v1.x): `num-cpus` / `memory` /
`num-gpus` come from the container's *limits* when rayStartParams lack them; `block`, `metrics-export-port` and
`dashboard-agent-listen-port` are always set (and `dashboard-host` on the head); a worker's `address` is the head
service's `host:6379`; parameters are joined as `--key=value` (`--key` for "true") into `ray start …` run by
`/bin/bash -lc --`, so a value is read by the shell (KubeRay's own `resources` convention: a quoted JSON string).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import yaml

NodeType = Literal["head", "worker"]
GCS_PORT = 6379
DASHBOARD_PORT = 8265
DASHBOARD_AGENT_PORT = 52365
RAY_METRICS_PORT = 8080
WORKER_GCS_RECONNECT_TIMEOUT_S = "600"  # KubeRay's DefaultWorkerRayGcsReconnectTimeoutS under GCS fault tolerance
# Set on every Ray container of a RayService-created cluster ("to improve service SLA", pod.go).
RAY_SERVICE_ENV = {"RAY_timeout_ms_task_wait_for_death_info": "0", "RAY_gcs_server_request_timeout_seconds": "5",
                   "RAY_SERVE_KV_TIMEOUT_S": "5"}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2", "3Gi", "1G") as a number."""
    s = str(value)
    if s.endswith("m"):
        return float(s[:-1]) / 1000
    for table in (_BINARY, _DECIMAL):
        for suffix, factor in table.items():
            if s.endswith(suffix):
                return float(s[: -len(suffix)]) * factor
    return float(s)


def _whole(value: str | int | float) -> int:
    """resource.Quantity.Value(): rounded up to an integer, as KubeRay formats num-cpus and memory."""
    q = quantity(value)
    return int(q) if q == int(q) else int(q) + 1


def start_params(group: dict[str, Any], node_type: NodeType, head_host: str) -> dict[str, str]:
    """`rayStartParams` completed as KubeRay's setMissingRayStartParams + generateRayStartCommand do."""
    params = {str(k): str(v) for k, v in (group.get("rayStartParams") or {}).items()}
    limits = ray_container(group)["resources"].get("limits", {})
    if node_type == "worker":
        params.setdefault("address", f"{head_host}:{GCS_PORT}")
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(RAY_METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(DASHBOARD_AGENT_PORT))
    if "num-cpus" not in params and limits.get("cpu"):
        params["num-cpus"] = str(_whole(limits["cpu"]))
    if "memory" not in params and limits.get("memory"):
        params["memory"] = str(_whole(limits["memory"]))
    if "num-gpus" not in params:
        for key, value in limits.items():
            if key.endswith("gpu") and quantity(value):
                params["num-gpus"] = str(_whole(value))
                break
    return params


def start_command(node_type: NodeType, params: dict[str, str]) -> str:
    """The shell line KubeRay puts in the Ray container's args."""
    flags = []
    for key, value in params.items():
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard"):
            if value.lower() == "true":
                flags.append(f"--{key}")
        else:
            flags.append(f"--{key}={value}")
    head = " --head" if node_type == "head" else ""
    return f"ray start{head} {' '.join(flags)}"


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    """The Ray container of a group's pod template (KubeRay: the first one)."""
    return dict(group["template"]["spec"]["containers"][0])


def _value(item: dict[str, Any], secrets: dict[tuple[str, str], str] | None) -> str:
    """An env var's (or a KubeRay option's) ``value``, or its ``valueFrom.secretKeyRef`` read from ``secrets``."""
    if "value" in item:
        return str(item["value"])
    ref = item["valueFrom"]["secretKeyRef"]
    return (secrets or {})[(ref["name"], ref["key"])]


def gcs_fault_tolerance_env(cluster: dict[str, Any], node_type: NodeType, storage_namespace: str,
                            secrets: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """What KubeRay's configureGCSFaultTolerance (pod.go) adds for the RayCluster's ``gcsFaultToleranceOptions``:
    on the head the GCS's Redis (``RAY_REDIS_ADDRESS``, ``REDIS_PASSWORD``) and its key prefix
    (``RAY_external_storage_namespace``: the ``ray.io/external-storage-namespace`` annotation, else the RayCluster's
    UID — here ``storage_namespace``, which stays the same across the head's restarts as a UID does); on a worker
    how long its raylet waits for a restarting head (600 s unless the container sets it)."""
    options = cluster.get("gcsFaultToleranceOptions")
    if options is None:
        return {}
    if node_type == "worker":
        return {"RAY_gcs_rpc_server_reconnect_timeout_s": WORKER_GCS_RECONNECT_TIMEOUT_S}
    env = {"RAY_REDIS_ADDRESS": str(options["redisAddress"]),
           "RAY_external_storage_namespace": str(options.get("externalStorageNamespace") or storage_namespace)}
    if "redisPassword" in options:
        env["REDIS_PASSWORD"] = _value(options["redisPassword"], secrets)
    return env


def container_env(group: dict[str, Any], node_type: NodeType, head_host: str, command: str,
                  secrets: dict[tuple[str, str], str] | None = None,
                  fault_tolerance: dict[str, str] | None = None) -> dict[str, str]:
    """The container's own env (secretKeyRef resolved from ``secrets``) plus what KubeRay adds for a RayService
    (``fault_tolerance``: gcs_fault_tolerance_env's)."""
    env: dict[str, str] = {item["name"]: _value(item, secrets) for item in ray_container(group).get("env", [])}
    for key, value in (fault_tolerance or {}).items():
        if key == "REDIS_PASSWORD" or key not in env:  # KubeRay appends; a later duplicate wins in a pod
            env[key] = value
    ip = "127.0.0.1" if node_type == "head" else head_host
    added = {"KUBERAY_GEN_RAY_START_CMD": command, "RAY_PORT": str(GCS_PORT), **RAY_SERVICE_ENV,
             "RAY_ADDRESS": f"{ip}:{GCS_PORT}", "REDIS_PASSWORD": "", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1"}
    if node_type == "worker":
        added.update(FQ_RAY_IP=head_host, RAY_IP=head_host)
    for key, value in added.items():
        env.setdefault(key, value)
    return env


def probe_paths(node_type: NodeType) -> list[tuple[int, str]]:
    """KubeRay's readiness probes of a RayService's Ray container: (port, path) that must answer 200."""
    paths = [(DASHBOARD_AGENT_PORT, "/api/local_raylet_healthz")]
    if node_type == "head":
        paths.append((DASHBOARD_PORT, "/api/gcs_healthz"))
    return paths


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One Ray pod as KubeRay would start it."""

    name: str
    node_type: NodeType
    group: str  # "headgroup" or the worker group's groupName (KubeRay's ray.io/group label)
    image: str
    command: str
    env: dict[str, str]
    cpu: float
    memory_bytes: int
    ports: tuple[int, ...]
    pre_stop: tuple[str, ...] = ()  # the container's lifecycle.preStop exec command, if any
    grace_s: int = 30  # the pod's terminationGracePeriodSeconds (Kubernetes' default 30)


def worker_group(ray_service: dict[str, Any], group_name: str | None = None) -> dict[str, Any]:
    """A worker group of ``ray_service`` by its ``groupName`` (the first group when None)."""
    groups = ray_service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    if group_name is None:
        return dict(groups[0])
    return dict(next(g for g in groups if g["groupName"] == group_name))


def node_spec(ray_service: dict[str, Any], node_type: NodeType, name: str, head_host: str,
              secrets: dict[tuple[str, str], str] | None = None, group_name: str | None = None,
              storage_namespace: str = "") -> NodeSpec:
    """The head, or a worker of group ``group_name`` (the first group when None), of ``ray_service``;
    ``storage_namespace`` stands for the RayCluster's UID (the GCS's key prefix in Redis under fault tolerance)."""
    cluster = ray_service["spec"]["rayClusterConfig"]
    group = cluster["headGroupSpec"] if node_type == "head" else worker_group(ray_service, group_name)
    container = ray_container(group)
    command = start_command(node_type, start_params(group, node_type, head_host))
    res = container["resources"]
    cpu = quantity(res.get("limits", {}).get("cpu") or res.get("requests", {}).get("cpu") or 1)
    memory = _whole(res.get("limits", {}).get("memory") or res.get("requests", {}).get("memory") or "1Gi")
    ft = gcs_fault_tolerance_env(cluster, node_type, storage_namespace or name, secrets)
    hook = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return NodeSpec(name, node_type, "headgroup" if node_type == "head" else str(group["groupName"]),
                    container["image"], command, container_env(group, node_type, head_host, command, secrets, ft),
                    cpu, memory, tuple(int(p["containerPort"]) for p in container.get("ports", [])),
                    tuple(hook), int(group["template"]["spec"].get("terminationGracePeriodSeconds", 30)))


def serve_config(ray_service: dict[str, Any]) -> dict[str, Any]:
    """`serveConfigV2` parsed: the body KubeRay PUTs to the head's /api/serve/applications/."""
    config = yaml.safe_load(ray_service["spec"]["serveConfigV2"])
    assert isinstance(config, dict)
    return config


def resources_flag(params: dict[str, str]) -> dict[str, float]:
    """The custom resources `ray start` will read from a `resources` parameter (after the shell's unquoting)."""
    raw = params.get("resources")
    if raw is None:
        return {}
    unquoted = json.loads(raw) if raw.startswith('"') else raw
    return dict(json.loads(unquoted))
