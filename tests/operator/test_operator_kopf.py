"""The operator end to end: kopf.testing.KopfRunner against the kmock Kubernetes API emulator over HTTP."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kopf
import yaml
from dmtd_samples import DMTD, DMTD_PATH, sample_cr
from kopf.testing import KopfRunner
from kube_emulator import KubeEmulator

HANDLERS = str(Path(importlib.util.find_spec("dmtd_operator").submodule_search_locations[0]) / "handlers.py")
RAY = "ray.io/v1/rayservices"


def operator() -> KopfRunner:
    # A file path (not -m) re-executes the module, so each runner gets its handlers in a fresh registry.
    return KopfRunner(
        ["run", "--standalone", "-A", "--verbose", HANDLERS], registry=kopf.OperatorRegistry(), timeout=30
    )


def serve_config(rs: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def replica_deployment(rs: dict[str, Any]) -> dict[str, Any]:
    (app,) = serve_config(rs)["applications"]
    return next(d for d in app["deployments"] if d["name"] == "DMTDReplica")


def rayservice_at(k8s: KubeEmulator, replicas_ok: Callable[[int], bool]) -> dict[str, Any] | None:
    """The RayService once its replica count satisfies `replicas_ok`."""
    rs = k8s.objects(RAY).get("demo-ray")
    return rs if rs is not None and replicas_ok(replica_deployment(rs)["num_replicas"]) else None


def status_of(k8s: KubeEmulator, name: str = "demo") -> dict[str, Any]:
    return k8s.objects(DMTD).get(name, {}).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in status.get("conditions", []) if c["type"] == kind), None)


def test_create_renders_rayservice_gateway_and_registry(k8s: KubeEmulator) -> None:
    with operator():
        assert k8s.request("POST", DMTD_PATH, sample_cr())[0] in (200, 201)
        rs = k8s.wait_for(lambda: k8s.objects(RAY).get("demo-ray"))
        k8s.wait_for(lambda: condition(status_of(k8s), "Reconciled") == "True")
    config = serve_config(rs)
    (app,) = config["applications"]
    assert app["import_path"] == "dmtd.serve.app:build_app"
    assert app["args"]["registry_url"] == "redis://dmtd-redis.dmtd:6379/0"
    assert app["args"]["variants"] == [
        {"name": "smollm2-dmtd", "variant": "none", "model": "hf://dmtd/smollm2-135m-dmtd", "weight": 100}
    ]
    replica = replica_deployment(rs)
    assert replica["num_replicas"] == 2
    assert "autoscaling_config" not in replica  # one control loop: Serve's autoscaler stays off
    assert replica["ray_actor_options"] == {"num_gpus": 1}
    assert replica["user_config"] == {"tau_min": 1, "tau_max": 1}
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    owner = rs["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("DMTDDeployment", "demo", True)
    services = k8s.objects("v1/services")
    assert {p["name"] for p in services["demo-gateway"]["spec"]["ports"]} == {"grpc", "http"}
    assert services["demo-metrics"]["spec"]["clusterIP"] == "None"
    entry = json.loads(k8s.objects("v1/configmaps")["demo-registry"]["data"]["entry.json"])
    assert entry["gateway"] == "demo-gateway.default.svc:9000" and entry["replicas"] == 2
    status = status_of(k8s)
    assert status["desiredReplicas"] == 2 and status["rayService"] == "demo-ray"


def test_spec_change_patches_the_rayservice(k8s: KubeEmulator) -> None:
    with operator():
        k8s.request("POST", DMTD_PATH, sample_cr())
        k8s.wait_for(lambda: k8s.objects(RAY).get("demo-ray"))
        change = {"spec": {"replicas": {"min": 3, "max": 6}, "serving": {"image": "registry.local/dmtd:v2"}}}
        assert k8s.request("PATCH", f"{DMTD_PATH}/demo", change)[0] == 200
        rs = k8s.wait_for(lambda: rayservice_at(k8s, lambda n: n == 3))
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "registry.local/dmtd:v2"
    assert list(k8s.objects(RAY)) == ["demo-ray"]
    assert k8s.count_requests("POST", "/rayservices") == 1
    assert k8s.count_requests("PATCH", "/rayservices/demo-ray") >= 1


def test_metrics_breach_scales_up_with_reason_in_status(k8s: KubeEmulator) -> None:
    window = {
        "windowS": 60,
        "ttftP95Ms": 2500,
        "itlP95Ms": 30,
        "queueDepth": 40,
        "gpuUtil": 0.97,
        "tokS": 2400,
        "requestsS": 20,
        "meanBlockLen": 1.0,
        "readyReplicas": 2,
    }
    with operator():
        k8s.request("POST", DMTD_PATH, sample_cr())
        k8s.wait_for(lambda: condition(status_of(k8s), "Reconciled") == "True")
        annotation = {"metadata": {"annotations": {"metrics.serving.dmtd.dev/window": json.dumps(window)}}}
        assert k8s.request("PATCH", f"{DMTD_PATH}/demo", annotation)[0] == 200
        k8s.wait_for(lambda: status_of(k8s).get("desiredReplicas", 0) > 2)
        rs = k8s.wait_for(lambda: rayservice_at(k8s, lambda n: n > 2))
    status = status_of(k8s)
    decision = status["lastDecision"]
    assert "ttft_p95 2500ms > SLO 1000ms" in decision["reason"]
    assert "scale up 2->" in decision["reason"]
    assert decision["tauMax"] > 1  # cold start bridged by a wider tau
    assert replica_deployment(rs)["user_config"]["tau_max"] == decision["tauMax"]
    assert status["observed"]["ttftP95Ms"] == 2500
    assert condition(status, "SLOMet") == "False"


def test_delete_removes_children_and_releases_finalizer(k8s: KubeEmulator) -> None:
    with operator():
        k8s.request("POST", DMTD_PATH, sample_cr())
        k8s.wait_for(lambda: "demo-registry" in k8s.objects("v1/configmaps"))
        finalizers = k8s.objects(DMTD)["demo"]["metadata"].get("finalizers", [])
        assert "serving.dmtd.dev/cleanup" in finalizers
        assert k8s.request("DELETE", f"{DMTD_PATH}/demo")[0] == 200
        k8s.wait_for(lambda: not k8s.objects(DMTD))
    assert k8s.objects(RAY) == {}
    assert k8s.objects("v1/services") == {}
    assert k8s.objects("v1/configmaps") == {}


def test_restart_mid_reconcile_creates_no_duplicates(k8s: KubeEmulator) -> None:
    with operator():
        k8s.request("POST", DMTD_PATH, sample_cr())
        k8s.wait_for(lambda: k8s.objects(RAY).get("demo-ray"))  # stop right after the first child exists
    with operator():
        k8s.wait_for(
            lambda: (
                condition(status_of(k8s), "Reconciled") == "True"
                and "demo-registry" in k8s.objects("v1/configmaps")
            )
        )
        k8s.wait_for(lambda: status_of(k8s).get("lastDecision", {}).get("time"))
    assert list(k8s.objects(RAY)) == ["demo-ray"]
    assert sorted(k8s.objects("v1/services")) == ["demo-gateway", "demo-metrics"]
    assert k8s.count_requests("POST", "/rayservices") == 1
    assert k8s.count_requests("POST", "/services") == 2


def test_invalid_spec_is_a_permanent_error(k8s: KubeEmulator) -> None:
    bad = sample_cr(
        variants=[{"name": "a", "modelUri": "x", "weight": 60}, {"name": "b", "modelUri": "y", "weight": 30}]
    )
    with operator() as runner:
        k8s.request("POST", DMTD_PATH, bad)
        # kopf records the permanent failure in the object's annotations: wait for that write.
        k8s.wait_for(lambda: k8s.count_requests("PATCH", "/dmtddeployments/demo") >= 1)
    assert "variant weights must sum to 100" in runner.output
    assert "failed permanently" in runner.output
    assert k8s.objects(RAY) == {}
