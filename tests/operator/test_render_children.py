"""Rendering of the owned objects and the idempotent create-or-patch, with an in-memory KubeApi."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import kopf
import pytest
import yaml
from manifests import validate_builtin
from pydantic import ValidationError

from dmtd_operator import crd, render
from dmtd_operator import resources as r
from dmtd_operator.children import api_errors, contains, ensure, ready_replicas, ref_of
from dmtd_operator.kube import ApiError, Body, ConflictError, NotFoundError, ObjectRef
from dmtd_operator.spec import DMTDDeploymentSpec


class MemoryKubeApi:
    """A KubeApi over a dict; `race_on_create` makes the next create lose a race to another writer."""

    def __init__(self) -> None:
        self.objects: dict[ObjectRef, Body] = {}
        self.calls: list[str] = []
        self.race_on_create = False

    async def get(self, ref: ObjectRef) -> Body | None:
        self.calls.append(f"get {ref.name}")
        return copy.deepcopy(self.objects.get(ref))

    async def create(self, ref: ObjectRef, body: Body) -> Body:
        self.calls.append(f"create {ref.name}")
        if self.race_on_create:
            self.race_on_create = False
            self.objects[ref] = {**copy.deepcopy(body), "spec": {"stale": True}}
        if ref in self.objects:
            raise ConflictError(409, "AlreadyExists", ref.name)
        self.objects[ref] = copy.deepcopy(body)
        return copy.deepcopy(body)

    async def patch(self, ref: ObjectRef, body: Body) -> Body:
        self.calls.append(f"patch {ref.name}")
        if ref not in self.objects:
            raise NotFoundError(404, "NotFound", ref.name)
        merged = self.objects[ref]
        for key, value in body.items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
        return copy.deepcopy(merged)

    async def delete(self, ref: ObjectRef) -> bool:
        return self.objects.pop(ref, None) is not None


def target(replicas: int = 3, tau_max: int = 2, **spec: Any) -> render.Target:
    raw = {
        "variants": [{"name": "v1", "modelUri": "registry://v1"}],
        "resources": {"gpusPerReplica": 2},
        **spec,
    }
    return render.Target(
        "demo",
        "ns",
        DMTDDeploymentSpec.model_validate(raw),
        replicas,
        1,
        tau_max,
        "redis://reg:6379/0",
        owner={
            "apiVersion": r.API_VERSION,
            "kind": r.KIND,
            "name": "demo",
            "uid": "u1",
            "controller": True,
            "blockOwnerDeletion": True,
        },
    )


def test_rayservice_carries_scale_tau_and_registry_in_serve_config() -> None:
    rs = render.ray_service(target())
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == r.SERVE_IMPORT_PATH and app["args"]["registry_url"] == "redis://reg:6379/0"
    assert (
        "num_replicas" not in app["args"]
    )  # args changes redeploy the app; the count is a lightweight override
    replica = next(d for d in app["deployments"] if d["name"] == r.REPLICA_DEPLOYMENT)
    assert replica == {
        "name": "DMTDReplica",
        "num_replicas": 3,
        "ray_actor_options": {"num_gpus": 2},
        "user_config": {"tau_min": 1, "tau_max": 2},
    }
    assert "grpc_options" not in config  # the Gateway deployment serves gRPC itself
    assert app["args"]["grpc_port"] == r.GATEWAY_GRPC_PORT
    gateway = next(d for d in app["deployments"] if d["name"] == r.GATEWAY_DEPLOYMENT)
    assert gateway["ray_actor_options"]["resources"] == {r.GATEWAY_RESOURCE: 1}
    assert gateway["num_replicas"] == 2  # one on each ingress pod (spec.serving.ingressReplicas)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert "resources" not in head  # no gateway on the head: clients do not depend on it
    (ingress,) = [g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == r.INGRESS_GROUP]
    assert json.loads(json.loads(ingress["rayStartParams"]["resources"])) == {r.GATEWAY_RESOURCE: 1}
    assert ingress["rayStartParams"]["num-cpus"] == "0" and ingress["minReplicas"] == ingress["maxReplicas"] == 2
    assert render.replicas_of(rs) == 3
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["workerGroupSpecs"][0]["maxReplicas"] == 4
    limits = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2"


def test_worker_and_ingress_pods_drain_in_a_pre_stop_before_their_sigterm() -> None:
    cluster = render.ray_service(target())["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]}
    for name in ("replicas", r.INGRESS_GROUP):
        pod = groups[name]
        (container,) = pod["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "dmtd.serve.pod_drain"]
        timeout_s = float(command[command.index("--timeout-s") + 1])
        assert timeout_s < pod["terminationGracePeriodSeconds"] == r.POD_GRACE_S  # Ray's own stop keeps some time
        assert f"http://127.0.0.1:{r.METRICS_PORT}/metrics" in command
    env = {e["name"]: e.get("value") for e in groups[r.INGRESS_GROUP]["containers"][0]["env"]}
    assert env["DMTD_DRAIN_FILE"] == r.DRAIN_FILE  # the file its gateway watches
    # not ready, yet still taking calls, until its readiness probe (every 2 s) has seen it
    assert float(env["DMTD_DRAIN_DELAY_S"]) > render.ingress_probe(False)["periodSeconds"]
    assert "DMTD_DRAIN_FILE" not in {e["name"] for e in groups["replicas"]["containers"][0]["env"]}
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert "lifecycle" not in head["containers"][0]  # nothing to drain there: no gateway, no replica


RAY_SERVICE_SPEC = {"serveConfigV2", "rayClusterConfig", "serveService", "upgradeStrategy"}
RAY_CLUSTER_SPEC = {
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headGroupSpec",
    "workerGroupSpecs",
    "gcsFaultToleranceOptions",
}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}


def test_rayservice_has_the_kuberay_v1_shape() -> None:
    """Structural check against KubeRay's ray.io/v1 types (a custom kind kubernetes-validate cannot know)."""
    rs = render.ray_service(target())
    assert (rs["apiVersion"], rs["kind"]) == ("ray.io/v1", "RayService")
    assert set(rs["spec"]) <= RAY_SERVICE_SPEC and isinstance(rs["spec"]["serveConfigV2"], str)
    cluster = rs["spec"]["rayClusterConfig"]
    assert set(cluster) <= RAY_CLUSTER_SPEC
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP and 0 <= group["minReplicas"] <= group["maxReplicas"]
    assert all(isinstance(v, str) for v in cluster["headGroupSpec"]["rayStartParams"].values())


def test_rendered_pods_and_services_validate_against_kubernetes() -> None:
    rs = render.ray_service(target())
    cluster = rs["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]]
    for tpl in templates:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", **tpl["metadata"]},
            "spec": tpl["spec"],
        }
        assert validate_builtin(pod) == "1.30"
    for svc in (render.gateway_service(target()), render.metrics_service(target())):
        assert validate_builtin(svc) == "1.30"
    assert rs["metadata"]["ownerReferences"][0]["uid"] == "u1"


def test_ensure_creates_then_leaves_unchanged_then_patches_only_drift() -> None:
    api = MemoryKubeApi()
    body = render.ray_service(target(replicas=3))
    assert asyncio.run(ensure(api, body))[1] == "created"
    live = api.objects[ref_of(body)]
    live["status"] = {"serviceStatus": "Running"}
    live["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = 3  # set by KubeRay's autoscaler
    assert asyncio.run(ensure(api, body))[1] == "unchanged"
    scaled = render.ray_service(target(replicas=5))
    _, action = asyncio.run(ensure(api, scaled))
    assert action == "patched"
    assert api.calls[-1] == "patch demo-ray"
    assert render.replicas_of(api.objects[ref_of(body)]) == 5
    assert api.objects[ref_of(body)]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 3


def test_ensure_turns_a_lost_create_race_into_a_patch() -> None:
    api = MemoryKubeApi()
    api.race_on_create = True
    body = render.gateway_service(target())
    live, action = asyncio.run(ensure(api, body))
    assert action == "patched" and api.calls == [
        "get demo-gateway",
        "create demo-gateway",
        "get demo-gateway",
        "patch demo-gateway",
    ]
    assert contains(live, body)


def test_ready_replicas_from_rayservice_status() -> None:
    rs: dict[str, Any] = {
        "status": {
            "activeServiceStatus": {
                "applicationStatuses": {
                    "dmtd": {"serveDeploymentStatuses": {"DMTDReplica": {"status": "UPDATING"}}}
                },
                "rayClusterStatus": {"readyWorkerReplicas": 2},
            }
        }
    }
    assert ready_replicas(rs, 4) == 2
    rs["status"]["activeServiceStatus"]["applicationStatuses"]["dmtd"]["serveDeploymentStatuses"][
        "DMTDReplica"
    ]["status"] = "HEALTHY"
    assert ready_replicas(rs, 4) == 4
    assert ready_replicas({}, 4) == 0


@pytest.mark.parametrize(
    ("error", "kind", "delay"),
    [
        (ConflictError(409, "Conflict", "x"), kopf.TemporaryError, 1),
        (NotFoundError(404, "NotFound", "no kind"), kopf.TemporaryError, 30),
        (ApiError(403, "Forbidden", "rbac"), kopf.TemporaryError, 60),
        (ApiError(503, "Unavailable", "x"), kopf.TemporaryError, 10),
        (ApiError(422, "Invalid", "x"), kopf.PermanentError, None),
        (TimeoutError(), kopf.TemporaryError, 10),
    ],
)
def test_api_errors_map_to_kopf_retry_policy(
    error: Exception, kind: type[Exception], delay: int | None
) -> None:
    async def fail() -> None:
        async with api_errors("applying"):
            raise error

    with pytest.raises(kind) as caught:
        asyncio.run(fail())
    if delay is not None:
        assert isinstance(caught.value, kopf.TemporaryError) and caught.value.delay == delay
    assert caught.value.__cause__ is error


def test_cpu_replicas_name_their_variant_and_stay_off_the_head() -> None:
    """What tests/cluster found running the RayService: build_app's variant keys, and CPUs that KubeRay passes on."""
    rs = render.ray_service(target(resources={"gpusPerReplica": 0}, serving={"workerCpu": "1500m"},
                                   variants=[{"name": "a", "modelUri": "registry://smollm2-135m-dmtd"},
                                             {"name": "b", "modelUri": "/models/x", "weight": 0}]))
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["variants"] == [{"name": "a", "variant": "smollm2-135m-dmtd", "weight": 100},
                                       {"name": "b", "variant": "none", "model": "/models/x", "weight": 0}]
    deps = {d["name"]: d for d in app["deployments"]}
    assert deps[r.REPLICA_DEPLOYMENT]["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    assert deps[r.GATEWAY_DEPLOYMENT]["ray_actor_options"]["num_cpus"] == 0
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    worker = cluster["workerGroupSpecs"][0]
    assert worker["rayStartParams"] == {"num-cpus": "2"}
    env = {e["name"]: e["value"] for e in worker["template"]["spec"]["containers"][0]["env"]}
    assert env["DMTD_TORCH_THREADS"] == "2"


def test_the_engine_settings_the_spec_sets_reach_the_serve_app_and_the_rest_keep_the_serving_defaults() -> None:
    """`spec.engine` is the serving side's own EngineSettings (camelCase): one set of defaults and rules, and the
    Serve app's arguments carry only what the spec changes, checked by the app's ServeConfig."""
    from dmtd_contract.serve_config import EngineSettings, ServeConfig

    plain = yaml.safe_load(render.ray_service(target())["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert not set(EngineSettings.model_fields) & set(plain)
    rs = render.ray_service(target(engine={"maxNumSeqs": 8, "drafts": "fixed", "phraseDrafts": False}))
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert {k: app["args"][k] for k in ("max_num_seqs", "drafts", "phrase_drafts")} == {
        "max_num_seqs": 8, "drafts": "fixed", "phrase_drafts": False}
    cfg = ServeConfig.parse(app["args"])  # what build_app reads
    assert cfg.engine(cfg.variants[0]) == EngineSettings(max_num_seqs=8, drafts="fixed", phrase_drafts=False)
    schema = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    engine = schema["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["maxNumSeqs"]["default"] == EngineSettings().max_num_seqs and engine["maxNumSeqs"]["minimum"] == 1
    with pytest.raises(ValidationError, match="maxNumSeqs"):
        target(engine={"maxNumSeqs": 0})
