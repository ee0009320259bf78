"""The DMTDDeployment CustomResourceDefinition, generated from the pydantic spec and status models.

Kubernetes wants a *structural* OpenAPI v3 schema: no `$ref`, a `type` on every node, `nullable`
instead of `anyOf [.., null]`, boolean `exclusiveMinimum`, no `additionalProperties` beside
`properties`. `structural()` turns pydantic's JSON Schema into that.

`python -m dmtd_operator.crd` prints the manifest; the chart ships that output in
`helm/dmtd/crds/` and a test keeps the two identical.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from dmtd_operator import resources
from dmtd_operator.spec import DEFAULT_GRPC_SERVICERS, DEFAULT_TAU_SPEEDUP, DMTDDeploymentSpec
from dmtd_operator.status import DMTDDeploymentStatus

_DROP = {"title", "additionalProperties", "$defs"}
_SPEC_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("capacity", "tauSpeedup"): list(DEFAULT_TAU_SPEEDUP),
    ("serving", "grpcServicerFunctions"): list(DEFAULT_GRPC_SERVICERS),
}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: dict[str, Any], *, keep_defaults: bool) -> dict[str, Any]:
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {any_of} structurally")
        node = {**non_null[0], **node, "nullable": True}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "default" and (not keep_defaults or value is None):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "properties":
            out[key] = {k: _structural(v, keep_defaults=keep_defaults) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, keep_defaults=keep_defaults)
        else:
            out[key] = value
    if "properties" in out:
        out["type"] = "object"
        if keep_defaults:
            required = set(out.get("required", []))
            for name, prop in out["properties"].items():
                if name not in required and prop.get("type") == "object" and "default" not in prop \
                        and not prop.get("nullable"):  # an optional object stays absent
                    prop["default"] = {}
    return out


def structural(model: type[BaseModel], *, keep_defaults: bool = True) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a pydantic model, by its aliases (the Kubernetes field names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(_resolve(raw, raw.get("$defs", {})), keep_defaults=keep_defaults)


def _set_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    for path, default in _SPEC_DEFAULTS.items():
        node = schema
        for part in path:
            node = node["properties"][part]
        node["default"] = default
    return schema


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the DMTDDeployment kind."""
    return {
        "type": "object",
        "description": "DMTDDeployment serves DMTD variants behind one gateway and keeps latency SLOs "
        "at the lowest GPU cost by scaling replicas and the cycle length tau.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _set_defaults(structural(DMTDDeploymentSpec)),
            "status": structural(DMTDDeploymentStatus, keep_defaults=False),
        },
    }


def crd_manifest() -> dict[str, Any]:
    """The complete CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": resources.CRD_NAME, "labels": {resources.LABEL_PART_OF: "dmtd"}},
        "spec": {
            "group": resources.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resources.KIND,
                "listKind": f"{resources.KIND}List",
                "plural": resources.PLURAL,
                "singular": resources.SINGULAR,
                "shortNames": list(resources.SHORT_NAMES),
            },
            "versions": [
                {
                    "name": resources.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
                        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                        {"name": "Tau", "type": "integer", "jsonPath": ".status.tau.max"},
                        {"name": "TTFT-p95", "type": "number", "jsonPath": ".status.observed.ttftP95Ms"},
                        {
                            "name": "Reason",
                            "type": "string",
                            "priority": 1,
                            "jsonPath": ".status.lastDecision.reason",
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render_yaml() -> str:
    """The CRD as the YAML document the chart ships."""
    header = "# Generated by `python -m dmtd_operator.crd`; do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    """Print the CRD, or write it to the path given as the only argument."""
    args = sys.argv[1:] if argv is None else argv
    text = render_yaml()
    if args:
        with open(args[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
