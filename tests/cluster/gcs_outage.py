"""The GCS outage driver, ``gcs_outage.py OUTAGE_S AFTER_S REDIS_DIR`` (run by test_gcs_loss.py in its own process,
inside a private network namespace): a Ray node whose GCS keeps its state in an external Redis
(``RAY_REDIS_ADDRESS``: GCS fault tolerance, as KubeRay's ``gcsFaultToleranceOptions`` sets it), the Serve app on
it, gRPC load through the gateway from before the GCS is killed until ``AFTER_S`` after it is back; a deploy tried
during the outage and after. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 3


class Load:
    """``CLIENTS`` closed-loop gRPC clients: short greedy requests back to back, each one recorded."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, i: int) -> None:
        from dmtd.client import DMTDClient

        with DMTDClient(self.target) as c:
            n = 0
            while not self._stop.is_set():
                n += 1
                t0 = time.time()
                rec: dict[str, Any] = {"client": i, "start": t0, "ok": False, "tokens": 0, "replicas": []}
                try:
                    for b in c.generate(prompt=f"Client {i} asks question {n}: name a colour.", max_new_tokens=12,
                                        ignore_eos=True, timeout_s=120):
                        rec["tokens"] += len(b.token_ids)
                        if b.replica and b.replica not in rec["replicas"]:
                            rec["replicas"].append(b.replica)
                    rec["ok"] = rec["tokens"] == 12
                except grpc.RpcError as e:
                    rec["error"] = f"{e.code().name}: {e.details()}"
                rec["end"] = time.time()
                self.records.append(rec)


def timed_deploy(name: str, limit_s: float = 90.0) -> dict[str, Any]:
    """Deploy a one-replica app (a control operation: Serve's KV store, an actor); its seconds and its error."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Probe:
        def __call__(self) -> str:
            return "ok"

    out: dict[str, Any] = {"ok": False, "error": None}

    def run() -> None:
        try:
            serve.run(Probe.bind(), name=name, route_prefix=None)
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 — recorded: the test asserts what it says
            out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"

    t = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit_s)
    out["seconds"] = time.monotonic() - t
    out["returned"] = not th.is_alive()
    return out


def main() -> int:
    outage_s, after_s, workdir = float(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    sys.path.insert(0, str(ROOT))
    from tests.serve.conftest import VARIANT, free_port, start_registry

    redis_proc, url = start_registry(workdir)
    redis_addr = url.removeprefix("redis://").split("/")[0]
    os.environ.update({"RAY_REDIS_ADDRESS": redis_addr, "RAY_external_storage_namespace": "dmtd-gcs-outage",
                       "RAY_SERVE_KV_TIMEOUT_S": "5", "RAY_gcs_rpc_server_reconnect_timeout_s": "300"})
    from dmtd.serve.local import prepare_environment

    prepare_environment(60.0)
    import ray
    from ray import serve
    from ray._private import worker as ray_worker

    from dmtd.serve.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="dmtd-gcs")
    grpc_port = free_port()
    serve.start(proxy_location="Disabled")
    app = build_app({"variants": [{"name": VARIANT, "variant": "none", "decoding_layers": 8, "tau_max": 4}],
                     "grpc_port": grpc_port, "max_num_seqs": 8, "registry_url": url, "omp_wait_policy": "PASSIVE"})
    serve.run(app, name="dmtd", route_prefix="/")
    gateway = serve.get_deployment_handle("Gateway", app_name="dmtd")
    gateway.wait_ready.remote(600).result()
    gateway_pid = gateway.info.remote().result()["pid"]
    node = ray_worker._global_node
    result: dict[str, Any] = {"gcs_external": bool(node.redis_address)}
    with Load(f"127.0.0.1:{grpc_port}") as load:
        time.sleep(4)
        result["t_kill"] = time.time()
        node.kill_gcs_server()
        result["during"] = timed_deploy("probe-during", limit_s=max(1.0, outage_s - 3))
        time.sleep(max(0.0, outage_s - (time.time() - result["t_kill"])))
        result["t_back"] = time.time()
        node.start_gcs_server()
        time.sleep(after_s)
    result["after"] = timed_deploy("probe-after", limit_s=180)
    result["records"] = load.records
    result["gateway_pid_same"] = gateway.info.remote().result()["pid"] == gateway_pid
    result["nodes_alive"] = sum(1 for n in ray.nodes() if n["Alive"])
    result["apps"] = {k: str(getattr(v.status, "value", v.status)) for k, v in serve.status().applications.items()}
    from dmtd_contract.registry import RegistryClient

    with RegistryClient(url) as reg:
        result["registry_status"] = str(reg.get(VARIANT).status)
    print(json.dumps(result), flush=True)
    serve.shutdown()
    ray.shutdown()
    redis_proc.terminate()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
