"""The DMTDDeployment CRD: generated from the pydantic models, structural, and it accepts/rejects CRs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from dmtd_samples import sample_cr
from manifests import CHART, CRD_FILE, cr_errors, crd_schema, validate_builtin
from pydantic import ValidationError

from dmtd_operator import crd, dashboard
from dmtd_operator.spec import DMTDDeploymentSpec


def test_chart_ships_the_generated_crd_and_dashboard() -> None:
    assert CRD_FILE.read_text() == crd.render_yaml(), "run: python -m dmtd_operator.crd " + str(CRD_FILE)
    board = CHART / "files" / "grafana-dashboard.json"
    assert board.read_text() == dashboard.render_json(), "run: python -m dmtd_operator.dashboard " + str(
        board
    )


def test_crd_is_a_valid_kubernetes_object() -> None:
    assert validate_builtin(crd.crd_manifest()) == "1.30"


def test_schema_is_structural() -> None:
    def walk(node: dict[str, Any], path: str) -> None:
        assert not {"$ref", "anyOf", "oneOf", "allOf", "$defs", "title"} & node.keys(), path
        assert "type" in node, path
        assert not ("properties" in node and "additionalProperties" in node), path
        for name, child in node.get("properties", {}).items():
            if name != "metadata":
                walk(child, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(crd_schema(), "")


def test_cross_field_rules_reach_the_api_server() -> None:
    spec = crd_schema()["properties"]["spec"]
    rules = {
        where: [r["rule"] for r in node.get("x-kubernetes-validations", [])]
        for where, node in {"spec": spec, **spec["properties"]}.items()
    }
    assert rules["spec"] == ["self.variants.map(v, v.weight).sum() == 100"]
    assert rules["replicas"] == ["self.min <= self.max"]
    assert rules["tau"] == ["self.min <= self.baseline && self.baseline <= self.max"]


def test_good_samples_pass() -> None:
    minimal = {
        "apiVersion": "serving.dmtd.dev/v1alpha1",
        "kind": "DMTDDeployment",
        "metadata": {"name": "m"},
        "spec": {"variants": [{"name": "a", "modelUri": "registry://a"}]},
    }
    for obj in (sample_cr(), minimal):
        assert cr_errors(obj) == []
        DMTDDeploymentSpec.model_validate(obj["spec"])


BAD: list[tuple[str, Any, str]] = [
    ("replicas.min", -1, "spec.replicas.min: -1 is less than the minimum of 0"),
    ("slo.ttftP95Ms", "fast", "spec.slo.ttftP95Ms: 'fast' is not of type 'number'"),
    ("slo.itlP95Ms", 0, "spec.slo.itlP95Ms: 0 is less than or equal to the minimum of 0"),
    ("tau.max", 9, "spec.tau.max: 9 is greater than the maximum of 8"),
    ("variants", [], "spec.variants: [] should be non-empty"),
    ("variants.0.name", "Bad_Name", "spec.variants.0.name: 'Bad_Name' does not match"),
    ("gpuUtilization.max", 1.5, "spec.gpuUtilization.max: 1.5 is greater than the maximum of 1"),
    ("scaling.scaleUpWindwS", 30, "spec.scaling: Additional properties are not allowed ('scaleUpWindwS'"),
    ("resources.gpusPerReplica", 1.5, "spec.resources.gpusPerReplica: 1.5 is not of type 'integer'"),
]


def _set(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    node: Any = obj["spec"]
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[leaf] = value
    return obj


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_samples_fail_naming_the_field(field: str, value: Any, message: str) -> None:
    errors = cr_errors(_set(sample_cr(), field, value))
    assert any(e.startswith(message) for e in errors), errors
    with pytest.raises(ValidationError):
        DMTDDeploymentSpec.model_validate(_set(sample_cr(), field, value)["spec"])


def test_missing_variants_is_reported() -> None:
    obj = sample_cr()
    del obj["spec"]["variants"]
    assert cr_errors(obj) == ["spec: 'variants' is a required property"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"replicas": {"min": 5, "max": 2}}, "replicas.min (5) must be <= replicas.max (2)"),
        ({"tau": {"min": 1, "baseline": 4, "max": 2}}, "tau needs min <= baseline <= max"),
        (
            {"variants": [{"name": "a", "modelUri": "x", "weight": 50}]},
            "variant weights must sum to 100, got 50",
        ),
        ({"tau": {"max": 6}}, "capacity.tauSpeedup has 4 entries, tau.max is 6"),
    ],
)
def test_cross_field_rules_in_the_operator(spec: dict[str, Any], message: str) -> None:
    raw = {**sample_cr()["spec"], **spec}
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DMTDDeploymentSpec.model_validate(raw)
