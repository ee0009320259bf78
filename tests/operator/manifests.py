"""Validation of Kubernetes manifests: built-in kinds by kubernetes-validate, ours by the CRD schema."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "dmtd"
CRD_FILE = CHART / "crds" / "dmtddeployments.serving.dmtd.dev.yaml"
K8S_VERSION = "1.30"


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Unknown fields rejected, as the API server does with field validation `Strict` (kubectl's default)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and node.get("type") == "object" and node["properties"]:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def cr_errors(obj: dict[str, Any]) -> list[str]:
    """Schema violations of a DMTDDeployment, each as `path: message` (empty when valid).

    OpenAPI v3 in a CRD is close to JSON Schema draft 4 (boolean exclusiveMinimum); CEL rules
    (x-kubernetes-validations) are evaluated by the API server only, and by pydantic in the operator.
    """
    validator = jsonschema.Draft4Validator(_strict(crd_schema()))
    return sorted(
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)
    )


def validate_builtin(doc: dict[str, Any]) -> str:
    """kubernetes-validate against the Kubernetes schema; returns the version validated against."""
    return kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def render_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]
