"""The Helm chart: lint and template with default and non-default values; every manifest validated."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests import CHART, ROOT, cr_errors, render_docs, validate_builtin

from dmtd_contract import metric_names
from dmtd_operator import render
from dmtd_operator import resources as r
from dmtd_operator.spec import DMTDDeploymentSpec

HELM = shutil.which("helm", path=str(ROOT / ".venv" / "bin")) or shutil.which("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not installed (run: bash scripts/install-helm.sh)")

VALUES: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis-namespaced": {
        "redis": {"enabled": False, "url": "redis://redis.example.internal:6379/2"},
        "operator": {"watchNamespaces": ["team-a", "team-b"], "logLevel": "debug", "metricsSource": "none"},
        "gateway": {
            "type": "LoadBalancer",
            "annotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"},
        },
        "serviceMonitor": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        "defaultDeployment": {"enabled": False},
    },
    "secret-redis-custom-deployment": {
        "redis": {"enabled": False, "existingSecret": "dmtd-redis-url", "existingSecretKey": "url"},
        "defaultDeployment": {
            "name": "canary",
            "spec": {
                "variants": [
                    {"name": "stable", "modelUri": "registry://qwen3-4b-dmtd", "weight": 90},
                    {"name": "canary", "modelUri": "registry://qwen3-4b-dmtd-v2", "weight": 10},
                ],
                "replicas": {"min": 0, "max": 12},
                "resources": {"gpusPerReplica": 2, "gpuType": "NVIDIA-A100-SXM4-80GB"},
                "tau": {"min": 1, "baseline": 2, "max": 4},
                "scaling": {"scaleUpWindowS": 15, "scaleDownWindowS": 600},
                "serving": {"image": "ghcr.io/dmtd/serving:0.1.0", "tlsSecret": "dmtd-gateway-tls",
                            "apiKeysSecret": {"name": "dmtd-api-keys", "key": "keys"}},
            },
        },
        "grafanaDashboard": {"namespace": "monitoring"},
    },
    "ephemeral-redis": {"redis": {"persistence": {"enabled": False}}, "gateway": {"type": "NodePort"}},
    "engine-settings": {
        "defaultDeployment": {
            "spec": {
                "variants": [{"name": "smollm2-dmtd", "modelUri": "registry://smollm2-135m-dmtd", "weight": 100}],
                "engine": {"maxNumSeqs": 16, "maxModelLen": 4096, "drafts": "fixed", "phraseDrafts": False},
            },
        },
    },
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def values_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(VALUES[name]))
    return path


def template(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    res = helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        "dmtd",
        "--include-crds",
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "-f",
        str(values_file(tmp_path, name)),
    )
    assert res.returncode == 0, res.stderr
    return render_docs(res.stdout)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_lint_passes(tmp_path: Path, name: str) -> None:
    res = helm("lint", "--strict", str(CHART), "-f", str(values_file(tmp_path, name)))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_rendered_manifest_validates(tmp_path: Path, name: str) -> None:
    docs = template(tmp_path, name)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount"} <= kinds
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == r.KIND:
            assert cr_errors(doc) == [], where
            DMTDDeploymentSpec.model_validate(doc["spec"])  # and the operator accepts it (CEL rules too)
        elif doc["kind"] == "ServiceMonitor":
            check_service_monitor(doc)
        else:
            assert validate_builtin(doc) == "1.30", where


def check_service_monitor(doc: dict[str, Any]) -> None:
    """Structural check (a CRD of the Prometheus operator): it must select what the operator creates."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    target = render.Target(
        "demo",
        "dmtd",
        DMTDDeploymentSpec.model_validate({"variants": [{"name": "v", "modelUri": "m"}]}),
        1,
        1,
        1,
        "redis://x",
    )
    svc = render.metrics_service(target)
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector.items() <= svc["metadata"]["labels"].items()
    (endpoint,) = doc["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint["interval"])


def test_default_values_render_the_whole_platform(tmp_path: Path) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in template(tmp_path, "default")}
    assert ("StatefulSet", "rel-dmtd-redis") in docs
    sts = docs[("StatefulSet", "rel-dmtd-redis")]
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert ("DMTDDeployment", "smollm2") in docs and ("ServiceMonitor", "rel-dmtd") in docs
    env = {
        e["name"]: e.get("value")
        for e in docs[("Deployment", "rel-dmtd-operator")]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DMTD_REGISTRY_URL"] == "redis://rel-dmtd-redis.dmtd.svc:6379/0"
    gateway = docs[("Service", "rel-dmtd-gateway")]
    assert gateway["spec"]["selector"] == {r.LABEL_INSTANCE: "smollm2", "ray.io/group": r.INGRESS_GROUP}
    dashboard = json.loads(docs[("ConfigMap", "rel-dmtd-dashboard")]["data"]["dmtd-platform.json"])
    used = set(re.findall(r"dmtd_[a-z_]+", json.dumps(dashboard)))
    known = {m.name for m in metric_names.ALL}
    assert {re.sub(r"_(bucket|sum|count)$", "", u) for u in used} <= known
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Latency SLOs", "Throughput", "tau and block length k", "Cost"} <= titles


def test_rbac_is_least_privilege(tmp_path: Path) -> None:
    cluster = [d for d in template(tmp_path, "default") if d["kind"] == "ClusterRole"]
    namespaced = template(tmp_path, "external-redis-namespaced")
    roles = [d for d in namespaced if d["kind"] == "Role"]
    assert len(cluster) == 1 and not [d for d in namespaced if d["kind"].startswith("Cluster")]
    assert sorted(d["metadata"]["namespace"] for d in roles) == ["team-a", "team-b"]
    for role in cluster + roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            assert not {"secrets", "pods", "nodes"} & set(rule["resources"])
    deployment = next(d for d in namespaced if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args


def test_external_redis_needs_a_url_or_a_secret(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"redis": {"enabled": False}}))
    res = helm("template", "rel", str(CHART), "-f", str(bad))
    assert res.returncode != 0
    assert "redis" in res.stderr and "url" in res.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"gateway": {"typ": "LoadBalancer"}}))
    res = helm("template", "rel", str(CHART), "-f", str(typo))
    assert res.returncode != 0 and "typ" in res.stderr


def test_api_keys_and_tls_secrets_reach_the_serving_pods(tmp_path: Path) -> None:
    """The chart renders the Secret references; the operator turns them into env, mounts and Serve options."""
    (cr,) = [d for d in template(tmp_path, "secret-redis-custom-deployment") if d["kind"] == r.KIND]
    assert cr["spec"]["serving"]["apiKeysSecret"] == {"name": "dmtd-api-keys", "key": "keys"}
    spec = DMTDDeploymentSpec.model_validate(cr["spec"])
    rs = render.ray_service(render.Target("canary", "dmtd", spec, 1, 1, 4, "redis://x"))
    cluster = rs["spec"]["rayClusterConfig"]
    for pod in (cluster["headGroupSpec"]["template"]["spec"], cluster["workerGroupSpecs"][0]["template"]["spec"]):
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["DMTD_API_KEYS"]["valueFrom"] == {"secretKeyRef": {"name": "dmtd-api-keys", "key": "keys"}}
        assert pod["volumes"] == [{"name": "tls", "secret": {"secretName": "dmtd-gateway-tls"}}]
        assert container["volumeMounts"][0]["mountPath"] == render.TLS_DIR
    serve_cfg = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert serve_cfg["http_options"]["ssl_certfile"] == f"{render.TLS_DIR}/tls.crt"
    assert serve_cfg["applications"][0]["args"]["tls_key_file"] == f"{render.TLS_DIR}/tls.key"
    assert "dmtd-api-keys" not in rs["spec"]["serveConfigV2"] and "keys" not in serve_cfg["applications"][0]["args"]
    plain = render.ray_service(render.Target("d", "dmtd", DMTDDeploymentSpec.model_validate(
        {"variants": [{"name": "v", "modelUri": "m"}]}), 1, 1, 1, "redis://x"))
    head = plain["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "volumes" not in head and all(e["name"] != "DMTD_API_KEYS" for e in head["containers"][0]["env"])


def test_engine_values_reach_the_serve_apps_arguments(tmp_path: Path) -> None:
    """The chart's `defaultDeployment.spec.engine` is the CRD's engine section: the operator passes what it sets to
    the Serve app, under the serving config's names; a value out of its rule is refused by the CRD's schema."""
    (cr,) = [d for d in template(tmp_path, "engine-settings") if d["kind"] == r.KIND]
    spec = DMTDDeploymentSpec.model_validate(cr["spec"])
    rs = render.ray_service(render.Target("smollm2", "dmtd", spec, 1, 1, 4, "redis://x"))
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert {k: args[k] for k in ("max_num_seqs", "max_model_len", "drafts", "phrase_drafts")} == {
        "max_num_seqs": 16, "max_model_len": 4096, "drafts": "fixed", "phrase_drafts": False}
    bad = {**cr, "spec": {**cr["spec"], "engine": {"maxNumSeqs": 0}}}
    assert any(e.startswith("spec.engine.maxNumSeqs") for e in cr_errors(bad))


def test_gcs_fault_tolerance_reaches_the_rayservice_from_the_charts_redis_or_its_own(tmp_path: Path) -> None:
    """With the chart's defaults the head's GCS writes to the chart's Redis (the registry's, under KubeRay's own key
    prefix); a spec may name another Redis and its password Secret, or turn it off; Serve's KV calls are bounded and
    workers outwait a restarting head either way it is on."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in template(tmp_path, "default")}
    cr = docs[("DMTDDeployment", "smollm2")]
    env = {e["name"]: e.get("value") for e in
           docs[("Deployment", "rel-dmtd-operator")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    spec = DMTDDeploymentSpec.model_validate(cr["spec"])
    rs = render.ray_service(render.Target("smollm2", "dmtd", spec, 1, 1, 4, env["DMTD_REGISTRY_URL"]))
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {"redisAddress": "rel-dmtd-redis.dmtd.svc:6379"}
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    head_env = {e["name"]: e.get("value") for e in head["env"]}
    worker_env = {e["name"]: e.get("value") for e in worker["env"]}
    assert head_env["RAY_SERVE_KV_TIMEOUT_S"] == worker_env["RAY_SERVE_KV_TIMEOUT_S"] == "5"
    assert worker_env["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
    assert "RAY_gcs_rpc_server_reconnect_timeout_s" not in head_env  # the head keeps Ray's 60 s: it restarts first
    assert "readinessProbe" not in head  # KubeRay's own: the gateways are on the ingress pods
    (ingress,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == r.INGRESS_GROUP]
    probe = ingress["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": r.GATEWAY_HTTP_PORT, "scheme": "HTTP"}  # warm, not up

    own = {**cr["spec"], "serving": {**cr["spec"]["serving"], "gcsFaultTolerance": {
        "redisAddress": "gcs-redis.infra.svc:6380", "redisPasswordSecret": {"name": "gcs-redis", "key": "password"},
        "serveKvTimeoutS": 2.5}}}
    assert cr_errors({**cr, "spec": own}) == []
    rs = render.ray_service(render.Target("smollm2", "dmtd", DMTDDeploymentSpec.model_validate(own), 1, 1, 4,
                                          env["DMTD_REGISTRY_URL"]))
    assert rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "gcs-redis.infra.svc:6380",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "gcs-redis", "key": "password"}}}}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in head["env"]}["RAY_SERVE_KV_TIMEOUT_S"] == "2.5"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ingress"},
           "spec": rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"]["spec"]}
    assert validate_builtin(pod) == "1.30"  # the probe included

    off = {**cr["spec"], "serving": {**cr["spec"]["serving"], "gcsFaultTolerance": {"enabled": False}}}
    rs = render.ray_service(render.Target("smollm2", "dmtd", DMTDDeploymentSpec.model_validate(off), 1, 1, 4,
                                          env["DMTD_REGISTRY_URL"]))
    assert "gcsFaultToleranceOptions" not in rs["spec"]["rayClusterConfig"]
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "RAY_gcs_rpc_server_reconnect_timeout_s" not in {e["name"] for e in worker["env"]}

    bad = {**cr, "spec": {**cr["spec"], "serving": {**cr["spec"]["serving"],
                                                    "gcsFaultTolerance": {"redisAddress": "redis://x:6379/0"}}}}
    assert any(e.startswith("spec.serving.gcsFaultTolerance.redisAddress") for e in cr_errors(bad))
    with pytest.raises(ValueError, match="gcsFaultTolerance.redisAddress"):  # no Redis host to default to
        render.ray_service(render.Target("smollm2", "dmtd", spec, 1, 1, 4, "configmap://registry"))
    password = render.gcs_fault_tolerance(render.Target("smollm2", "dmtd", spec, 1, 1, 4, "redis://:s3cret@r:7000/1"))
    assert password == {"redisAddress": "r:7000", "redisPassword": {"value": "s3cret"}}
