"""Tracing through the real stack: the gateway span is the root (or the caller's child), the replica span
(in another Ray process) its child, with admission, prefill, per-block and finish events; JSON logs of both
processes carry the request id with the trace id."""

from __future__ import annotations

import glob
import json
import os
import time
import uuid

import grpc

from dmtd.client import build_request
from dmtd.v1 import generate_pb2_grpc as pbg
from tests.serve.conftest import VARIANT


def spans_of(stack, deployment: str, trace_id: str, names: set[str], timeout_s: float = 10.0) -> list[dict]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=stack.app)
    deadline = time.monotonic() + timeout_s
    while True:
        spans = handle.finished_spans.remote(trace_id).result()
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def generate(stack, request_id: str, metadata: tuple = (), **kw) -> list:
    with grpc.insecure_channel(stack.grpc_target) as ch:
        call = pbg.GenerateServiceStub(ch).Generate(build_request(request_id=request_id, **kw), metadata=metadata,
                                                    timeout=120)
        return list(call)


def test_gateway_and_replica_spans_form_one_trace_with_block_events(stack):
    parent_trace, parent_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    rid = "trace-" + uuid.uuid4().hex[:8]
    blocks = generate(stack, rid, (("traceparent", f"00-{parent_trace}-{parent_span}-01"),),
                      prompt="Tell me about the moon.", max_new_tokens=12, ignore_eos=True, tau_min=3, tau_max=3)
    assert sum(b.k for b in blocks) == 12
    (gw,) = [s for s in spans_of(stack, "Gateway", parent_trace, {"dmtd.gateway.generate"})
             if s["name"] == "dmtd.gateway.generate"]
    assert gw["parent_span_id"] == parent_span and gw["attributes"]["dmtd.request_id"] == rid
    assert gw["attributes"]["dmtd.variant"] == VARIANT and gw["attributes"]["dmtd.tokens"] == 12
    assert [e["name"] for e in gw["events"]] == ["admission", "first_block", "finish"]
    assert gw["events"][-1]["attributes"]["code"] == "OK"

    (rep,) = [s for s in spans_of(stack, "DMTDReplica", parent_trace, {"dmtd.replica.generate"})
              if s["name"] == "dmtd.replica.generate"]
    assert rep["trace_id"] == gw["trace_id"] == parent_trace
    assert rep["parent_span_id"] == gw["span_id"], "replica span must be the gateway span's child"
    assert rep["service"] == "dmtd-replica" and gw["service"] == "dmtd-gateway"
    assert gw["start_ns"] <= rep["start_ns"] and rep["end_ns"] <= gw["end_ns"]
    names = [e["name"] for e in rep["events"]]
    assert names[0] == "admitted" and "prefill" in names and names[-1] == "finish"
    block_events = [e["attributes"] for e in rep["events"] if e["name"] == "block"]
    assert [(e["k"], e["tau"]) for e in block_events] == [(b.k, b.tau) for b in blocks]
    assert [e["index"] for e in block_events] == list(range(len(blocks)))
    finish = rep["events"][-1]["attributes"]
    assert finish["reason"] == "length" and finish["completion_tokens"] == 12 and finish["gpu_seconds"] > 0
    assert rep["attributes"]["dmtd.request_id"] == rid


def test_new_trace_without_caller_context_and_logs_correlate(stack):
    rid = "logs-" + uuid.uuid4().hex[:8]
    generate(stack, rid, prompt="Hello", max_new_tokens=6, ignore_eos=True)
    from ray import serve

    gw_handle = serve.get_deployment_handle("Gateway", app_name=stack.app)
    deadline = time.monotonic() + 10
    while True:
        mine = [s for s in gw_handle.finished_spans.remote().result() if s["attributes"].get("dmtd.request_id") == rid]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    (gw,) = mine
    assert gw["parent_span_id"] is None  # the gateway started the trace
    rep = [s for s in spans_of(stack, "DMTDReplica", gw["trace_id"], {"dmtd.replica.generate"})]
    assert [s["parent_span_id"] for s in rep] == [gw["span_id"]]

    import ray

    logs_dir = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    found: dict[str, dict] = {}
    deadline = time.monotonic() + 10
    while len(found) < 2 and time.monotonic() < deadline:
        for path in glob.glob(os.path.join(logs_dir, "**", "*.err"), recursive=True):
            with open(path, errors="replace") as f:
                for line in f:
                    if rid in line and line.lstrip().startswith("{"):
                        rec = json.loads(line)
                        found[rec["logger"]] = rec
        time.sleep(0.2)
    assert set(found) == {"dmtd.gateway.requests", "dmtd.replica.requests"}, found
    for rec in found.values():
        assert rec["request_id"] == rid and rec["trace_id"] == gw["trace_id"] and rec["msg"] == "request finished"
    assert found["dmtd.replica.requests"]["completion_tokens"] == 6 and found["dmtd.gateway.requests"]["tokens"] == 6


def test_openai_http_request_joins_the_callers_trace(stack):
    import urllib.request

    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    body = json.dumps({"model": VARIANT, "prompt": "The sea is", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(stack.http_url + "/v1/completions", body, method="POST",
                                 headers={"content-type": "application/json",
                                          "traceparent": f"00-{trace_id}-{span_id}-01"})
    reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert reply["usage"]["completion_tokens"] >= 1
    (gw,) = [s for s in spans_of(stack, "Gateway", trace_id, {"dmtd.gateway.generate"})
             if s["name"] == "dmtd.gateway.generate"]
    assert gw["parent_span_id"] == span_id
    rep = spans_of(stack, "DMTDReplica", trace_id, {"dmtd.replica.generate"})
    assert [s["parent_span_id"] for s in rep] == [gw["span_id"]]
