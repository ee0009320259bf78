"""Pure rendering of the objects a DMTDDeployment owns: the KubeRay RayService and two Services.

Ray Serve's own autoscaling stays off: each deployment has a fixed `num_replicas` that only the operator
changes (a lightweight, in-place Serve update), and the replicas' tau bounds travel in `user_config`
(also lightweight: Serve calls the replica's `reconfigure`). Pods follow the Serve replicas through
KubeRay's in-tree node autoscaler, which only provisions what pending actors need.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

from dmtd_contract.serve_config import ServeConfig
from dmtd_operator import resources as r
from dmtd_operator.spec import DMTDDeploymentSpec, Variant

Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Target:
    """What to render: which deployment, at what scale and tau, registered where."""

    name: str
    namespace: str
    spec: DMTDDeploymentSpec
    replicas: int
    tau_min: int
    tau_max: int
    registry_url: str
    owner: Body | None = None


def _meta(t: Target, name: str, component: str) -> Body:
    meta: Body = {"name": name, "namespace": t.namespace, "labels": r.child_labels(t.name, component)}
    if t.owner is not None:
        meta["ownerReferences"] = [t.owner]
    return meta


TLS_DIR = "/etc/dmtd/tls"


def _tls_args(t: Target) -> tuple[Body, Body]:
    """Serve's HTTP ``ssl_*`` options and the gateway's gRPC TLS files, from the mounted TLS Secret."""
    if not t.spec.serving.tls_secret:
        return {}, {}
    cert, key = f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key"
    return {"ssl_certfile": cert, "ssl_keyfile": key}, {"tls_cert_file": cert, "tls_key_file": key}


REGISTRY_SCHEME = "registry://"


def variant_args(v: Variant) -> Body:
    """One CRD variant as ``build_app`` reads it: ``registry://<id>`` names a variant the image ships
    (``variant``); any other URI is the model the replica loads (``model``: a directory, ``smollm2`` the
    embedded default). A bare ``model_uri`` reached ``build_app`` as the variant's *name*, which no replica
    could resolve (tests/cluster: DEPLOY_FAILED, "variant 'smollm2-dmtd' not found")."""
    tails = {"tails": [t.removeprefix(REGISTRY_SCHEME) for t in v.tails]} if v.tails else {}
    if v.model_uri.startswith(REGISTRY_SCHEME):
        return {"name": v.name, "variant": v.model_uri.removeprefix(REGISTRY_SCHEME), "weight": v.weight, **tails}
    return {"name": v.name, "variant": "none", "model": v.model_uri, "weight": v.weight, **tails}


def worker_cpus(spec: DMTDDeploymentSpec) -> int:
    """Whole CPUs of one worker pod: its Ray ``num-cpus``, a CPU replica's ``num_cpus`` and torch threads."""
    return max(1, math.ceil(quantity_cpu(spec.serving.worker_cpu)))


def quantity_cpu(value: str) -> float:
    """A Kubernetes CPU quantity ("500m", "4") in cores."""
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def _replica_actor(spec: DMTDDeploymentSpec) -> Body:
    """A CPU replica takes its whole worker pod (one replica per pod, as with GPUs); a GPU replica its GPUs."""
    gpus = spec.resources.gpus_per_replica
    return {"num_gpus": gpus} if gpus else {"num_cpus": worker_cpus(spec), "num_gpus": 0}


def serve_args(t: Target, grpc_tls: Body) -> Body:
    """The Serve app's arguments (`build_app`'s `ServeConfig`), validated by that model: the engine settings the
    spec sets (the others keep the serving side's defaults), the variants, where to listen and what to report."""
    s = t.spec
    args: Body = {
        "deployment": t.name,
        "namespace": t.namespace,
        "registry_url": t.registry_url,
        "variants": [variant_args(v) for v in s.variants],
        "gpus_per_replica": s.resources.gpus_per_replica,
        "metrics_port": r.METRICS_PORT,
        "grpc_host": "0.0.0.0",
        "grpc_port": r.GATEWAY_GRPC_PORT,
        "http_host": "0.0.0.0",
        "http_port": r.GATEWAY_HTTP_PORT,
        "gateway_resources": {r.GATEWAY_RESOURCE: 1},
        "usd_per_gpu_hour": s.cost.usd_per_gpu_hour,
        "replica_type": s.resources.gpu_type or "gpu",
        **grpc_tls,
        **s.engine.model_dump(exclude_defaults=True),
    }
    return ServeConfig.parse(args).model_dump(mode="json", exclude_unset=True)


def serve_config(t: Target) -> Body:
    """The Serve config (serveConfigV2) as a dict."""
    s = t.spec
    http_tls, grpc_tls = _tls_args(t)
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": r.SERVE_HTTP_PORT, **http_tls},
        # gRPC is served by the Gateway deployment's own grpc.aio server (docs/architecture.md): one replica on
        # each ingress pod (a custom resource only they offer), never on the head, so that clients keep being
        # served while the head (GCS, Serve's controller) is down; the gateway Service targets the ingress pods.
        "applications": [
            {
                "name": r.SERVE_APP_NAME,
                "route_prefix": s.serving.route_prefix,
                "import_path": r.SERVE_IMPORT_PATH,
                "args": serve_args(t, grpc_tls),
                "deployments": [
                    {
                        "name": r.REPLICA_DEPLOYMENT,
                        "num_replicas": t.replicas,
                        "ray_actor_options": _replica_actor(s),
                        "user_config": {"tau_min": t.tau_min, "tau_max": t.tau_max},
                    },
                    {
                        "name": r.GATEWAY_DEPLOYMENT,
                        "num_replicas": s.serving.ingress_replicas,
                        # no CPU: the ingress pods offer none (below), so no engine replica lands beside a gateway
                        "ray_actor_options": {"num_cpus": 0, "resources": {r.GATEWAY_RESOURCE: 1}},
                    },
                ],
            }
        ],
    }


def gcs_redis_address(t: Target) -> str:
    """host:port of the Redis the GCS writes to: the spec's, else the registry's (``redis://[user:pw@]host:port/db``)."""
    ft = t.spec.serving.gcs_fault_tolerance
    if ft.redis_address:
        return ft.redis_address
    parsed = urlsplit(t.registry_url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise ValueError(f"spec.serving.gcsFaultTolerance.redisAddress: empty, and the registry URL "
                         f"{t.registry_url!r} names no Redis host to default to; set it (host:port)")
    return f"{parsed.hostname}:{parsed.port or 6379}"


def gcs_fault_tolerance(t: Target) -> Body | None:
    """KubeRay's ``gcsFaultToleranceOptions`` of the RayCluster, or None when turned off."""
    ft = t.spec.serving.gcs_fault_tolerance
    if not ft.enabled:
        return None
    options: Body = {"redisAddress": gcs_redis_address(t)}
    if ft.redis_password_secret is not None:
        ref = ft.redis_password_secret
        options["redisPassword"] = {"valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
    elif not ft.redis_address and urlsplit(t.registry_url).password:  # the registry's, as its URL carries it
        options["redisPassword"] = {"value": urlsplit(t.registry_url).password}
    return options


def ingress_probe(tls: bool) -> Body:
    """An ingress pod's readiness: its gateway's ``/healthz`` says 200, i.e. warm (dmtd.serve.readiness); 503 while
    warming or draining, nothing listening before KubeRay submitted the Serve config: not ready either way, so the
    gateway Service sends no client to a pod that cannot serve yet (KubeRay waits for the head pod only, which keeps
    its own default probe, before it submits)."""
    return {"httpGet": {"path": "/healthz", "port": r.GATEWAY_HTTP_PORT, "scheme": "HTTPS" if tls else "HTTP"},
            "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 1, "successThreshold": 1}


def pre_stop() -> Body:
    """A worker or ingress pod's preStop: drain its gateway (if it runs one) and wait until no stream is in flight on
    the pod, so that the SIGTERM that follows (it stops Ray there) cuts none — KubeRay's switch-over deleting the old
    RayCluster after a new serving image, a node drained, a scale-in (dmtd.serve.pod_drain)."""
    return {"exec": {"command": ["python", "-m", "dmtd.serve.pod_drain", "--timeout-s", str(r.PRE_STOP_TIMEOUT_S),
                                 "--metrics-url", f"http://127.0.0.1:{r.METRICS_PORT}/metrics"]}}


def _env(t: Target, name: str) -> list[Body]:
    worker = name != "ray-head"
    env: list[Body] = [
        {"name": "DMTD_DEPLOYMENT", "value": t.name},
        {"name": "DMTD_REGISTRY_URL", "value": t.registry_url},
        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
    ]
    ft = t.spec.serving.gcs_fault_tolerance
    # bounded Serve control calls (KubeRay sets 5 s on a RayService too; set here so it holds whatever sets it)
    env.append({"name": "RAY_SERVE_KV_TIMEOUT_S", "value": f"{ft.serve_kv_timeout_s:g}"})
    if worker and ft.enabled:  # workers outwait the head's restart (KubeRay's own default with GCS FT: 600)
        env.append({"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": str(ft.worker_reconnect_timeout_s)})
    if name == "ray-ingress":  # its gateway drains when the preStop creates this file (dmtd.serve.pod_drain)
        env.append({"name": "DMTD_DRAIN_FILE", "value": r.DRAIN_FILE})
        env.append({"name": "DMTD_DRAIN_DELAY_S", "value": str(r.DRAIN_DELAY_S)})
    if name == "ray-worker":  # a replica's torch threads: its pod's CPUs, not every core of the node (os.cpu_count())
        env.append({"name": "DMTD_TORCH_THREADS", "value": str(worker_cpus(t.spec))})
    ref = t.spec.serving.api_keys_secret
    if ref is not None:  # read by the gateway (dmtd.serve.auth); the keys never enter the Serve config
        env.append({"name": "DMTD_API_KEYS", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _pod(t: Target, container: Body, **extra: Any) -> Body:
    """A pod spec around ``container``, with the TLS Secret mounted when there is one."""
    pod: Body = {"containers": [container], **extra}
    if t.spec.serving.tls_secret:
        container["volumeMounts"] = [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]
        pod["volumes"] = [{"name": "tls", "secret": {"secretName": t.spec.serving.tls_secret}}]
    return pod


def _container(t: Target, name: str, cpu: str, memory: str, gpus: int) -> Body:
    limits: Body = {"memory": memory}
    requests: Body = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
        requests["nvidia.com/gpu"] = str(gpus)
    return {
        "name": name,
        "image": t.spec.serving.image,
        "env": _env(t, name),
        "ports": [
            {"name": "serve", "containerPort": r.SERVE_HTTP_PORT},
            {"name": "grpc", "containerPort": r.GATEWAY_GRPC_PORT},
            {"name": "gateway-http", "containerPort": r.GATEWAY_HTTP_PORT},
            {"name": "metrics", "containerPort": r.METRICS_PORT},
        ],
        "resources": {"requests": requests, "limits": limits},
    }


def ray_service(t: Target) -> Body:
    """The KubeRay RayService (ray.io/v1) running the DMTD Serve application."""
    s = t.spec
    gpus = s.resources.gpus_per_replica
    worker = _container(t, "ray-worker", s.serving.worker_cpu, s.serving.worker_memory, gpus)
    worker["lifecycle"] = {"preStop": pre_stop()}
    worker_pod = _pod(t, worker, terminationGracePeriodSeconds=r.POD_GRACE_S)
    if gpus:
        worker_pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        if s.resources.gpu_type:
            worker_pod["nodeSelector"] = {"nvidia.com/gpu.product": s.resources.gpu_type}
    labels = r.child_labels(t.name, "serving")
    head = _container(t, "ray-head", s.serving.head_cpu, s.serving.head_memory, 0)
    ingress = _container(t, "ray-ingress", s.serving.ingress_cpu, s.serving.ingress_memory, 0)
    ingress["readinessProbe"] = ingress_probe(bool(s.serving.tls_secret))
    ingress["lifecycle"] = {"preStop": pre_stop()}
    cluster: Body = {
        "rayVersion": s.serving.ray_version,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 60},
    }
    if (ft := gcs_fault_tolerance(t)) is not None:
        cluster["gcsFaultToleranceOptions"] = ft
    return {
        "apiVersion": r.RAY_API_VERSION,
        "kind": r.RAY_SERVICE_KIND,
        "metadata": _meta(t, r.ray_service_name(t.name), "serving"),
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(t), sort_keys=False),
            "rayClusterConfig": {
                **cluster,
                "headGroupSpec": {
                    # KubeRay takes num-cpus from the container's CPU *limit* only; the pods set requests, so
                    # without these Ray would offer every core of the node. The head offers none: it runs the
                    # GCS, Serve's controller and proxy (num_cpus 0), never a replica nor a gateway.
                    "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": _pod(t, head),
                    },
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "replicas",
                        "minReplicas": 0,
                        "maxReplicas": s.replicas.max,
                        "rayStartParams": {"num-cpus": str(worker_cpus(s))},
                        "template": {"metadata": {"labels": labels}, "spec": worker_pod},
                    },
                    {
                        # the gateways, one a pod (the custom resource), and nothing else: no CPU nor GPU offered
                        "groupName": r.INGRESS_GROUP,
                        "replicas": s.serving.ingress_replicas,
                        "minReplicas": s.serving.ingress_replicas,
                        "maxReplicas": s.serving.ingress_replicas,
                        "rayStartParams": {
                            "num-cpus": "0",
                            "num-gpus": "0",
                            "resources": json.dumps(json.dumps({r.GATEWAY_RESOURCE: 1})),
                        },
                        "template": {"metadata": {"labels": labels},
                                     "spec": _pod(t, ingress, terminationGracePeriodSeconds=r.POD_GRACE_S)},
                    },
                ],
            },
        },
    }


def gateway_service(t: Target) -> Body:
    """ClusterIP Service on the ingress pods: the Gateway deployment's gRPC and HTTP servers there."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(t, r.gateway_service_name(t.name), "gateway"),
        "spec": {
            "type": "ClusterIP",
            "selector": {r.LABEL_INSTANCE: t.name, "ray.io/group": r.INGRESS_GROUP},
            "ports": [
                {
                    "name": "grpc",
                    "port": r.GATEWAY_GRPC_PORT,
                    "targetPort": r.GATEWAY_GRPC_PORT,
                    "appProtocol": "grpc",
                },
                # the gateway's own HTTP server: Serve's proxy (SERVE_HTTP_PORT) stays for KubeRay's health checks
                {"name": "http", "port": r.SERVE_HTTP_PORT, "targetPort": r.GATEWAY_HTTP_PORT},
            ],
        },
    }


def metrics_service(t: Target) -> Body:
    """Headless Service over every serving pod, scraped by the chart's ServiceMonitor."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(t, r.metrics_service_name(t.name), "metrics"),
        "spec": {
            "clusterIP": "None",
            "selector": {r.LABEL_INSTANCE: t.name},
            "ports": [{"name": "metrics", "port": r.METRICS_PORT, "targetPort": r.METRICS_PORT}],
        },
    }


def replicas_of(ray_service_body: Body) -> int | None:
    """`num_replicas` of the replica deployment in a live RayService, or None if unreadable."""
    try:
        config = yaml.safe_load(ray_service_body["spec"]["serveConfigV2"])
        for app in config["applications"]:
            for dep in app.get("deployments", []):
                if dep.get("name") == r.REPLICA_DEPLOYMENT:
                    return int(dep["num_replicas"])
    except (KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    return None
