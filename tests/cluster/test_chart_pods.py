"""The chart's own pods under `podman kube play`: the Redis StatefulSet and the operator Deployment start with
the chart's args, env, read-only root and probes; the operator reaches kmock for the Kubernetes API and the Redis
pod, by its Service name, for the registry."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from dmtd_contract.registry import RegistryClient, VariantSpec
from tests.cluster import kubeplay as kp
from tests.cluster.cluster import PodNetwork, podman
from tests.images.chart import create_in, variants_active
from tests.operator.dmtd_samples import DMTD_PATH
from tests.operator.kube_emulator import KubeEmulator

REDIS_IMAGE = ("redis.image.repository=localhost/dmtd/redis", "redis.image.tag=7-bookworm")


def wait(check: Callable[[], object], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except (OSError, redis.RedisError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        time.sleep(0.5)


def containers_of(pod: str) -> dict[str, dict[str, Any]]:
    """Container name (as charted) → podman's inspect of it, for the pod's non-infra containers."""
    ids = podman("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.ID}}").split()
    out = {}
    for cid in ids:
        info = kp.inspect(cid)
        if not info.get("IsInfra"):
            out[str(info["Name"]).removeprefix(f"{pod}-")] = info
    return out


def test_chart_pods_start_with_charted_settings_and_reach_kmock_and_redis(network: PodNetwork,
                                                                           tmp_path: Path) -> None:
    docs = kp.helm_template(*REDIS_IMAGE)
    sts, dep = kp.one(docs, "StatefulSet", "-redis"), kp.one(docs, "Deployment", "-operator")
    cr = kp.one(docs, "DMTDDeployment", "")
    configmaps = [d for d in docs if d["kind"] == "ConfigMap"]
    redis_service = f"{kp.one(docs, 'Service', '-redis')['metadata']['name']}.dmtd.svc"
    redis_ip, operator_ip = network.address(5), network.address(6)
    redis_yaml, operator_yaml = tmp_path / "redis.yaml", tmp_path / "operator.yaml"
    redis_pod = f"{sts['metadata']['name']}-0"
    with KubeEmulator(host=network.gateway) as k8s:
        try:
            kp.play(kp.statefulset_pod(sts), redis_yaml, network.name, redis_ip)
            url = f"redis://{redis_ip}:6379/0"
            redis_up = wait(lambda: redis.Redis.from_url(url, socket_timeout=1).ping(), 60, "the Redis pod")
            with RegistryClient(url) as reg:  # a variant's owner registers it; the operator activates it
                for v in cr["spec"]["variants"]:
                    reg.register(VariantSpec.model_validate({"name": v["name"], "num_thinking_layers": 22,
                                                             "num_decoding_layers": 8, "tau_max": 4}))
            kubeconfig = k8s.kubeconfig(tmp_path / "kubeconfig").read_text()
            kp.play([*configmaps, kp.configmap("kmock-kubeconfig", "dmtd", {"config": kubeconfig}),
                  kp.with_cluster_services(dep, {redis_service: redis_ip}, "kmock-kubeconfig")],
                 operator_yaml, network.name, operator_ip)
            t0 = time.monotonic()
            rs = create_in(k8s, cr, DMTD_PATH)
            k8s.wait_for(lambda: variants_active(url, cr), timeout_s=60)
            reconciled_s = time.monotonic() - t0
            redis_c = containers_of(redis_pod)["redis"]
            operator_pod = podman("pod", "ps", "--filter", f"name={dep['metadata']['name']}", "--format",
                                  "{{.Name}}").split()[0]
            operator_c = containers_of(operator_pod)["operator"]
            probes = {}
            for cname, spec, ip, info in (
                    ("redis", sts["spec"]["template"]["spec"]["containers"][0], redis_ip, redis_c),
                    ("operator", dep["spec"]["template"]["spec"]["containers"][0], operator_ip, operator_c)):
                for kind in ("livenessProbe", "readinessProbe"):
                    if kind in spec:
                        probes[f"{cname} {kind}"] = kp.probe_passes(spec, spec[kind], ip, str(info["Name"]))
        except Exception:
            for pod in (redis_pod, dep["metadata"]["name"]):
                print(podman("pod", "logs", "--tail", "40", pod, check=False))
            raise
        finally:
            kp.down(operator_yaml)
            kp.down(redis_yaml)
            for volume in (f"data-{redis_pod}", "kmock-kubeconfig"):  # the PVC's and the ConfigMap's
                podman("volume", "rm", "-f", volume, check=False)
    charted = {c["name"]: c for c in [*sts["spec"]["template"]["spec"]["containers"],
                                      *dep["spec"]["template"]["spec"]["containers"]]}
    for cname, info in (("redis", redis_c), ("operator", operator_c)):
        config, host = info["Config"], info["HostConfig"]
        want = charted[cname]
        assert host["ReadonlyRootfs"] is True, cname
        assert config["Cmd"][-len(want["args"]):] == want["args"], (cname, config["Cmd"])
        env = dict(e.split("=", 1) for e in config["Env"])
        assert {e["name"]: e["value"] for e in want.get("env", [])}.items() <= env.items(), cname
        assert config.get("Healthcheck"), cname  # podman's translation of the liveness probe
        assert str(config["User"]).startswith(str(
            (dep if cname == "operator" else sts)["spec"]["template"]["spec"]["securityContext"]["runAsUser"]))
    assert probes and all(probes.values()), probes
    assert set(probes) == {"redis livenessProbe", "redis readinessProbe", "operator livenessProbe"}
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["image"] == cr["spec"]["serving"]["image"]
    print(f"chart pods: Redis answering {redis_up:.1f} s after kube play; the operator's RayService in kmock and "
          f"its registry writes in the Redis pod {reconciled_s:.1f} s after the DMTDDeployment was created; "
          f"probes passing: {', '.join(probes)}")
