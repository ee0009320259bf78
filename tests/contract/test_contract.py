"""The contract package: torch-free and Ray-free on its own, records that survive Ray's pickling, one
percentile, one variant schema."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import fields

from dmtd.engine.config import DMTDConfig
from dmtd.variants.manifest import VariantManifest
from dmtd_contract.records import Block, ReplicaRequest, Usage
from dmtd_contract.stats import percentile
from dmtd_contract.variant_schema import HEAD_INPUTS, PHASE_ANCHORS, STATUSES


def test_importing_the_whole_contract_loads_nothing_of_ours_and_no_torch_or_ray() -> None:
    code = ("import json, sys, dmtd_contract.registry, dmtd_contract.records, dmtd_contract.metric_names, "
            "dmtd_contract.stats, dmtd_contract.variant_schema; print(json.dumps(sorted({m.split('.')[0] "
            "for m in sys.modules})))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True, timeout=60).stdout))
    assert not loaded & {"torch", "ray", "grpc", "kopf", "dmtd", "dmtd_operator", "numpy"}
    assert {"dmtd_contract", "redis", "pydantic"} <= loaded


def test_records_survive_pickling_and_every_field_has_a_default() -> None:
    req = ReplicaRequest("r1", prompt="Hi", stop=["\n"], tau_max=3)
    block = Block("r1", [5, 6], "ab", 2, 2, 3, 0.5, (0.4, 0.6, 0.9), 12.5, 0.0, "replica-1", "length", None,
                  Usage(5, 2, 1, 1, 0))
    assert pickle.loads(pickle.dumps(req)) == req and pickle.loads(pickle.dumps(block)) == block
    assert block.usage is not None and block.usage.as_dict()["completion_tokens"] == 2
    for record, required in ((ReplicaRequest, 1), (Block, 1), (Usage, 0)):
        no_default = [f.name for f in fields(record) if f.default is f.default_factory]
        assert len(no_default) == required, (record.__name__, no_default)


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # order does not matter
    assert percentile(values, 0.95) == 95.0 and percentile(values, 0.5) == 50.0 and percentile(values, 0.951) == 96.0
    assert percentile([], 0.95) == 0.0 and percentile([3.0], 0.99) == 3.0
    assert percentile(values, 1.0) == 100.0 and percentile(values, 0.0) == 1.0


def test_one_variant_schema_for_engine_manifest_and_registry() -> None:
    assert PHASE_ANCHORS == ("prompt_end", "absolute") and HEAD_INPUTS == ("residual_add", "replace")
    assert STATUSES == ("staged", "active", "retired")
    schema = VariantManifest.model_json_schema()["properties"]
    assert tuple(schema["phase_anchor"]["enum"]) == PHASE_ANCHORS and tuple(schema["head_input"]["enum"]) == HEAD_INPUTS
    assert DMTDConfig(0, 4, 2, 3, "absolute", "residual_add").phase_anchor == "absolute"
