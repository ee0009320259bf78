"""The operator restarted in the middle of a reconcile: the RayService written, the gateway Service's create in flight
(kmock has stored it; its answer never reaches the operator), the operator stopped there, the spec changed while it
was down. The next operator finishes the job idempotently:
no duplicate child, the spec change applied (none lost), the status converged to the new generation."""

from __future__ import annotations

import asyncio
from typing import Any

from dmtd_samples import DMTD, DMTD_PATH, sample_cr
from kube_emulator import KubeEmulator
from test_operator_kopf import RAY, condition, operator, replica_deployment, status_of

SERVICES_PATH = "/api/v1/namespaces/default/services"


def test_restart_mid_reconcile_is_idempotent_and_loses_no_spec_change(k8s: KubeEmulator) -> None:
    stalled = {"on": True, "held": 0}

    async def stall(_: Any) -> Any:
        """Hold the answer to each Service create while ``on`` (the emulator has stored the object by then), then
        let the emulator answer it (``NotImplemented``: the next rule)."""
        stalled["held"] += 1
        while stalled["on"]:
            await asyncio.sleep(0.05)
        return NotImplemented

    assert k8s.handler is not None
    k8s.call(lambda: k8s.handler[f"post {SERVICES_PATH}"] << stall)  # type: ignore[index]
    with operator():
        k8s.request("POST", DMTD_PATH, sample_cr())
        k8s.wait_for(lambda: k8s.objects(RAY).get("demo-ray") and stalled["held"] >= 1)
        assert "demo-metrics" not in k8s.objects("v1/services") and not status_of(k8s)  # stopped mid-reconcile
    # while no operator runs: a spec change (scale and image), and the API server answers again
    change = {"spec": {"replicas": {"min": 3, "max": 6}, "serving": {"image": "registry.local/dmtd:v2"}}}
    assert k8s.request("PATCH", f"{DMTD_PATH}/demo", change)[0] == 200
    stalled["on"] = False
    generation = k8s.objects(DMTD)["demo"]["metadata"]["generation"]
    with operator():
        k8s.wait_for(lambda: status_of(k8s).get("observedGeneration") == generation
                     and condition(status_of(k8s), "Reconciled") == "True")
        rs = k8s.wait_for(lambda: (lambda rs: rs if rs and replica_deployment(rs)["num_replicas"] == 3 else None)(
            k8s.objects(RAY).get("demo-ray")))
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "registry.local/dmtd:v2"  # the change made while the operator was down
    assert list(k8s.objects(RAY)) == ["demo-ray"] and k8s.count_requests("POST", "/rayservices") == 1
    assert sorted(k8s.objects("v1/services")) == ["demo-gateway", "demo-metrics"]
    assert k8s.count_requests("POST", "/services") == 2  # the lost answer's object was found and patched, not re-posted
    assert "demo-registry" in k8s.objects("v1/configmaps")
    status = status_of(k8s)
    assert status["desiredReplicas"] == 3 and status["rayService"] == "demo-ray"
