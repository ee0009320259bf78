"""The chart's workloads through `podman kube play`: what a kubelet would get, plus the two things a cluster adds
that podman has not: Service names (`hostAliases` to the pod addresses) and API credentials (a kubeconfig for
kmock in place of the service-account token; in a ConfigMap, as podman 4.3's kube play dies on a secret volume:
nil pointer in VolumeFromSecret). A StatefulSet becomes its pod `<name>-0` with the PVC its
volumeClaimTemplate makes (podman 4.3 plays Pods, Deployments, PVCs, ConfigMaps and Secrets, not StatefulSets)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.cluster import podman
from tests.images.podman import CHART, PODMAN, ROOT

Doc = dict[str, Any]


def helm_template(*sets: str) -> list[Doc]:
    helm = shutil.which("helm", path=str(ROOT / ".venv" / "bin")) or shutil.which("helm")
    assert helm is not None, "helm is missing (scripts/install-helm.sh installs it)"
    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "dmtd", *args], capture_output=True,
                         text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[Doc], kind: str, suffix: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return copy.deepcopy(doc)


def statefulset_pod(sts: Doc) -> list[Doc]:
    """Pod `<name>-0` and its PVC `<claim>-<name>-0`, as the StatefulSet controller makes them."""
    name = f"{sts['metadata']['name']}-0"
    spec = copy.deepcopy(sts["spec"]["template"]["spec"])
    docs: list[Doc] = []
    for claim in sts["spec"].get("volumeClaimTemplates", []):
        claim_name = f"{claim['metadata']['name']}-{name}"
        docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": claim_name, "namespace": sts["metadata"]["namespace"]},
                     "spec": claim["spec"]})
        spec.setdefault("volumes", []).append({"name": claim["metadata"]["name"],
                                               "persistentVolumeClaim": {"claimName": claim_name}})
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": sts["metadata"]["namespace"],
                        "labels": sts["spec"]["template"]["metadata"]["labels"]},
           "spec": spec}
    return [*docs, pod]


def with_cluster_services(deployment: Doc, aliases: dict[str, str], kubeconfig_configmap: str) -> Doc:
    """``deployment`` with Service names resolved to pod addresses and a kubeconfig in place of the token."""
    dep = copy.deepcopy(deployment)
    pod = dep["spec"]["template"]["spec"]
    pod["hostAliases"] = [{"ip": ip, "hostnames": [host]} for host, ip in aliases.items()]
    (container,) = pod["containers"]
    container["env"] = [*container.get("env", []), {"name": "KUBECONFIG", "value": "/var/run/kmock/config"}]
    container.setdefault("volumeMounts", []).append({"name": "kmock", "mountPath": "/var/run/kmock",
                                                     "readOnly": True})
    pod.setdefault("volumes", []).append({"name": "kmock", "configMap": {"name": kubeconfig_configmap}})
    return dep


def configmap(name: str, namespace: str, data: dict[str, str]) -> Doc:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
            "data": data}


def play(docs: list[Doc], path: Path, network: str, ip: str) -> str:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return podman("kube", "play", "--network", network, "--ip", ip, str(path), timeout=180)


def down(path: Path) -> None:
    podman("kube", "down", str(path), check=False, timeout=120)


def inspect(container: str) -> Doc:
    import json

    return dict(json.loads(podman("inspect", container))[0])


def probe_passes(container: Doc, probe: Doc, pod_ip: str, podman_name: str) -> bool:
    """One probe of ``container`` run as the kubelet runs it: httpGet / tcpSocket from outside the pod (a named
    port resolved from the container's ports, which podman 4.3's healthcheck translation leaves at 0), exec in it."""
    import socket
    import urllib.request

    ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    if "exec" in probe:
        return subprocess.run([*PODMAN, "exec", podman_name, *probe["exec"]["command"]], capture_output=True,
                              timeout=30).returncode == 0
    kind = "httpGet" if "httpGet" in probe else "tcpSocket"
    port = probe[kind]["port"]
    port = ports[port] if isinstance(port, str) else int(port)
    if kind == "tcpSocket":
        with socket.create_connection((pod_ip, port), timeout=2):
            return True
    with urllib.request.urlopen(f"http://{pod_ip}:{port}{probe['httpGet'].get('path', '/')}", timeout=3) as resp:
        return 200 <= resp.status < 400
