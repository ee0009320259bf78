"""A Ray cluster started from a rendered RayService the way KubeRay starts it: one podman container per pod, on a
podman bridge network of this test's private network namespace (each node its own address, as pods have)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dmtd_operator.resources import GATEWAY_GRPC_PORT, INGRESS_GROUP
from tests.cluster import kuberay
from tests.images.podman import PODMAN

SHM_BYTES = 512 * 2**20  # KubeRay sizes /dev/shm by the memory request; Ray falls back to /tmp when it is small


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    out = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} failed: {out.stderr.strip()[-800:]}")
    return out.stdout.strip()


def http_json(method: str, url: str, body: Any = None, timeout: float = 10) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


@dataclass
class PodNetwork:
    """A podman bridge network; its gateway address is this namespace's side of the bridge."""

    name: str
    subnet_prefix: str  # "10.89.7"

    @property
    def gateway(self) -> str:
        return f"{self.subnet_prefix}.1"

    def address(self, host: int) -> str:
        return f"{self.subnet_prefix}.{host}"

    def create(self) -> PodNetwork:
        podman("network", "rm", "-f", self.name, check=False)
        podman("network", "create", "--subnet", f"{self.subnet_prefix}.0/24", "--gateway", self.gateway, self.name)
        return self

    @staticmethod
    def remove_stale(prefix: str) -> None:
        """Networks ``<prefix><pid>`` whose test process is gone (a run killed before its teardown): a later run
        whose pid maps to the same subnet could not create its own."""
        for name in podman("network", "ls", "--format", "{{.Name}}", check=False).split():
            pid = name.removeprefix(prefix)
            if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                podman("network", "rm", "-f", name, check=False)

    def remove(self) -> None:
        podman("network", "rm", "-f", self.name, check=False)


@dataclass
class RayNode:
    """One Ray pod: a container running KubeRay's command for its group, at a fixed address."""

    spec: kuberay.NodeSpec
    network: PodNetwork
    ip: str
    cpus: float
    id: str = ""

    def start(self) -> RayNode:
        podman("rm", "-f", self.spec.name, check=False)
        env = [a for k, v in self.spec.env.items() for a in ("-e", f"{k}={v}")]
        self.id = podman("run", "-d", "--name", self.spec.name, "--hostname", self.spec.name,
                         "--network", self.network.name, "--ip", self.ip, "--cpus", str(self.cpus),
                         "--memory", str(self.spec.memory_bytes), "--shm-size", str(SHM_BYTES), *env,
                         "--entrypoint", "/bin/bash", self.spec.image, "-lc", "--", self.spec.command)
        return self

    def ready(self) -> bool:
        """KubeRay's readiness probes, sent from outside the pod as the kubelet does."""
        for port, path in kuberay.probe_paths(self.spec.node_type):
            try:
                with urllib.request.urlopen(f"http://{self.ip}:{port}{path}", timeout=2) as resp:
                    if resp.status != 200:
                        return False
            except (OSError, urllib.error.URLError):
                return False
        return True

    def running(self) -> bool:
        return podman("inspect", "-f", "{{.State.Running}}", self.spec.name, check=False) == "true"

    def kill(self) -> float:
        """SIGKILL to every process of the pod, as a lost node; the wall-clock time podman saw it die."""
        podman("kill", self.spec.name)
        podman("wait", self.spec.name, check=False)
        stamp = json.loads(podman("inspect", "-f", "{{json .State.FinishedAt}}", self.spec.name))
        whole, _, frac = stamp.rstrip("Z").partition(".")
        return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + float(f"0.{frac or 0}")

    def pre_stop(self) -> tuple[float, str]:
        """The pod deleted, as the kubelet stops it, first part: its preStop hook exec'd in the container (none: at
        once); the hook's seconds and its stdout (its stderr when it wrote nothing else)."""
        t0 = time.monotonic()
        out = ""
        if self.spec.pre_stop:
            done = subprocess.run([*PODMAN, "exec", self.spec.name, *self.spec.pre_stop], capture_output=True,
                                  text=True, timeout=self.spec.grace_s + 30)
            out = done.stdout.strip() or f"(rc {done.returncode}) {done.stderr.strip()[-2000:]}"
        return time.monotonic() - t0, out

    def stop(self, after_s: float = 0.0) -> None:
        """Second part: SIGTERM, then SIGKILL once what is left of the grace period (``after_s`` went to the
        preStop) is over."""
        left = max(1, int(self.spec.grace_s - after_s))
        podman("stop", "-t", str(left), self.spec.name, check=False, timeout=left + 60)

    def logs(self, tail: int = 60) -> str:
        out = subprocess.run([*PODMAN, "logs", "--tail", str(tail), self.spec.name], capture_output=True, text=True,
                             timeout=60)
        return out.stdout + out.stderr

    def ray_logs(self, tail: int = 25) -> str:
        """The tails of Ray's own logs in the pod (raylet, and the workers' stderr that names a crash)."""
        script = (f"cd /tmp/ray/session_latest/logs 2>/dev/null && for f in raylet.out $(ls -t worker-*.err "
                  f"2>/dev/null | head -3); do echo \"== $f\"; tail -n {tail} $f; done")
        out = subprocess.run([*PODMAN, "exec", self.spec.name, "bash", "-c", script], capture_output=True,
                             text=True, timeout=60)
        return out.stdout[-8000:]

    def remove(self) -> None:
        podman("rm", "-f", "-t", "2", self.spec.name, check=False, timeout=120)


@dataclass
class RayCluster:
    """The head, ``num_workers`` workers of the replica group and the ingress group's pods (as many as the rendered
    group's ``minReplicas``) of a RayService, started as KubeRay would, and its Serve REST API. Each pod's env is
    the rendered container's plus KubeRay's, GCS fault tolerance included (kuberay.gcs_fault_tolerance_env, from
    the rendered ``gcsFaultToleranceOptions``)."""

    ray_service: dict[str, Any]
    network: PodNetwork
    num_workers: int = 2
    prefix: str = "dmtd"
    host_base: int = 0  # added to each pod's host number on the network: a second cluster beside the first
    head: RayNode = field(init=False)
    workers: list[RayNode] = field(default_factory=list)
    ingress: list[RayNode] = field(default_factory=list)
    start_s: float = 0.0  # nodes started until all ready
    deploy_s: float = 0.0  # serve config submitted until the app runs

    def __post_init__(self) -> None:
        head_ip = self.network.address(self.host_base + 10)
        uid = f"{self.prefix}-raycluster"  # the RayCluster's UID: the GCS's key prefix in Redis, kept over restarts
        spec = kuberay.node_spec(self.ray_service, "head", f"{self.prefix}-head", head_ip, storage_namespace=uid)
        self.head = RayNode(spec, self.network, head_ip, spec.cpu)
        for i in range(self.num_workers):
            ip = self.network.address(self.host_base + 20 + i)
            wspec = kuberay.node_spec(self.ray_service, "worker", f"{self.prefix}-worker-{i}", head_ip)
            self.workers.append(RayNode(wspec, self.network, ip, wspec.cpu))
        group = kuberay.worker_group(self.ray_service, INGRESS_GROUP)
        for i in range(int(group["minReplicas"])):
            ispec = kuberay.node_spec(self.ray_service, "worker", f"{self.prefix}-ingress-{i}", head_ip,
                                      group_name=INGRESS_GROUP)
            self.ingress.append(RayNode(ispec, self.network, self.network.address(self.host_base + 40 + i),
                                        ispec.cpu))

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.ip}:{kuberay.DASHBOARD_PORT}"

    @property
    def nodes(self) -> list[RayNode]:
        return [self.head, *self.workers, *self.ingress]

    def gateways(self) -> list[str]:
        """``host:port`` of the gateway (gRPC) on each ingress pod, as the gateway Service's endpoints."""
        return [f"{n.ip}:{GATEWAY_GRPC_PORT}" for n in self.ingress]

    @property
    def gateway(self) -> str:
        """The first ingress pod's gateway: where single-entry tests send their requests."""
        return self.gateways()[0]

    def start(self, timeout_s: float = 240) -> float:
        """Head first, then the workers (KubeRay's workers wait for the head's GCS); seconds until all are ready."""
        t0 = time.monotonic()
        self.head.start()
        self.wait_ready([self.head], timeout_s)
        for w in [*self.workers, *self.ingress]:
            w.start()
        self.wait_ready([*self.workers, *self.ingress], timeout_s - (time.monotonic() - t0))
        self.wait_nodes(len(self.nodes), timeout_s - (time.monotonic() - t0))
        return time.monotonic() - t0

    def restart_head(self, timeout_s: float = 180) -> float:
        """The head pod comes back as KubeRay brings it back: a new container from the image (a fresh filesystem) at
        the head's address; seconds until it is ready."""
        t0 = time.monotonic()
        self.head.start()
        self.wait_ready([self.head], timeout_s)
        return time.monotonic() - t0

    def wait_ready(self, nodes: list[RayNode], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(nodes)
        while pending:
            for n in list(pending):
                if not n.running():
                    raise RuntimeError(f"{n.spec.name} exited:\n{n.logs()}")
                if n.ready():
                    pending.remove(n)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready: {[n.spec.name for n in pending]}\n{pending[0].logs()}")
            time.sleep(1)

    def alive_nodes(self) -> list[dict[str, Any]]:
        status, body = http_json("GET", f"{self.dashboard}/nodes?view=summary", timeout=10)
        if status != 200 or not isinstance(body, dict):
            return []
        return [n for n in body["data"]["summary"] if n.get("raylet", {}).get("state") == "ALIVE"]

    def wait_nodes(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.alive_nodes())} Ray nodes alive, expected {count}")
            time.sleep(1)

    def submit(self, serve_config: dict[str, Any]) -> None:
        """What KubeRay's RayService controller does with serveConfigV2: PUT it to the head's dashboard, through
        the head Service. While the head pod is gone that Service has no endpoint, and kube-proxy rejects the
        connection at once (here the address would just not answer until the client's timeout)."""
        if not self.head.running():
            raise ConnectionRefusedError(f"the head Service has no endpoint ({self.head.spec.name} is not running): "
                                         f"PUT {self.dashboard}/api/serve/applications/ refused")
        status, body = http_json("PUT", f"{self.dashboard}/api/serve/applications/", serve_config, timeout=60)
        if status != 200:
            raise RuntimeError(f"the dashboard refused the serve config: {status} {body}")

    def serve_details(self) -> dict[str, Any]:
        status, body = http_json("GET", f"{self.dashboard}/api/serve/applications/", timeout=20)
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"serve details: {status} {body}")
        return body

    def replicas(self, deployment: str, app: str = "dmtd") -> list[dict[str, Any]]:
        try:
            deps = self.serve_details()["applications"][app]["deployments"]
        except (KeyError, RuntimeError):
            return []
        return list(deps.get(deployment, {}).get("replicas", []))

    def running_replicas(self, deployment: str, app: str = "dmtd") -> list[dict[str, Any]]:
        return [r for r in self.replicas(deployment, app) if r.get("state") == "RUNNING"]

    def wait_app(self, app: str, timeout_s: float, replicas: dict[str, int] | None = None) -> float:
        """Seconds until ``app`` is RUNNING (and each named deployment has that many RUNNING replicas)."""
        t0 = time.monotonic()
        last: Any = None
        while time.monotonic() - t0 < timeout_s:
            try:
                last = self.serve_details()["applications"].get(app)
            except RuntimeError as e:
                last = str(e)
            if isinstance(last, dict):
                if last.get("status") == "DEPLOY_FAILED":
                    why = {d: (v.get("status"), v.get("message")) for d, v in last.get("deployments", {}).items()}
                    raise RuntimeError(f"{app}: DEPLOY_FAILED: {last.get('message')} {why}")
                counts_ok = all(len(self.running_replicas(d, app)) == n for d, n in (replicas or {}).items())
                if last.get("status") == "RUNNING" and counts_ok:
                    return time.monotonic() - t0
            time.sleep(1)
        raise TimeoutError(f"{app} not running after {timeout_s} s: {json.dumps(last)[:1500]}")

    def node_of(self, ip: str) -> RayNode:
        return next(n for n in self.nodes if n.ip == ip)

    def remove(self) -> None:
        for n in [*self.ingress, *self.workers, self.head]:
            n.remove()
