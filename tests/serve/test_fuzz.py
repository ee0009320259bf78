"""Property-based fuzzing of both APIs against the live stack, each case followed by a check that a stream
already in flight keeps advancing.

The OpenAI API's cases come from its own OpenAPI document (``/openapi.json``) through schemathesis, in its
positive (schema-valid) and negative (schema-violating, including non-JSON bodies) modes; the gRPC cases are
``GenerateRequest``s with every field drawn over its whole wire range, plus corrupted serializations.
``make test`` runs ``DMTD_FUZZ_CASES`` (default 40) cases per API with the fixed seed ``DMTD_FUZZ_SEED``;
a longer run: ``DMTD_FUZZ_CASES=2000 .venv/bin/python -m pytest tests/serve/test_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from typing import Any

import grpc
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from dmtd.client import build_request
from dmtd.v1 import generate_pb2 as pb
from tests.serve.conftest import FUZZ_REPORT, VARIANT
from tests.serve.heartbeat import INTERNAL_NAMES, budget

CASES = int(os.environ.get("DMTD_FUZZ_CASES", "40"))
SEED = int(os.environ.get("DMTD_FUZZ_SEED", "20261201"))
FIELD_RULE = re.compile(r"^[a-z_]+(\.[a-z_]+|\[\d+\])*: .+", re.S)
MAX_BLOCKS = 8  # a case that generates is read this far, then cancelled


def fuzz_settings(fn: Any) -> Any:
    return seed(SEED)(settings(max_examples=CASES, database=None, deadline=None, phases=[Phase.generate, Phase.shrink],
                               suppress_health_check=list(HealthCheck))(fn))


def tame(body: Any, model: str | None) -> Any:
    """Keep generation short (a valid case would otherwise decode up to 4096 tokens on a CPU)."""
    if isinstance(body, dict):
        body = dict(body)
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                body[key] = min(v, 4)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
        if model is not None:
            body["model"] = model
    return body


def check_http(r: requests.Response, streamed: bool) -> None:
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300])
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"], err
        assert err["message"].startswith(err["param"]) and not any(n in err["message"] for n in INTERNAL_NAMES), err
    elif r.status_code == 200 and streamed:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    elif r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_api_fuzzed_from_its_openapi_schema(stack, heartbeat):
    schema = schemathesis.openapi.from_dict(requests.get(stack.http_url + "/openapi.json", timeout=10).json())
    paths = ("/v1/chat/completions", "/v1/completions")
    cases = st.one_of(*[st.tuples(st.just(p), schema[p]["POST"].as_strategy(generation_mode=m))
                        for p in paths for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    tally: Counter[str] = Counter()
    waits: list[float] = []

    @fuzz_settings
    @given(cases, st.sampled_from([VARIANT, "", None]))
    def one(path_case: tuple[str, Any], model: str | None) -> None:
        path, case = path_case
        body = tame(case.body, model)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        streamed = isinstance(body, dict) and body.get("stream") is True
        sent = time.monotonic()
        r = requests.post(stack.http_url + path, data=data, timeout=60, headers={"content-type": "application/json"})
        check_http(r, streamed)
        waits.append(heartbeat.assert_advances(sent, budget(heartbeat)))
        tally[f"{r.status_code}"] += 1

    one()
    report("http", tally, waits, heartbeat)
    assert sum(tally.values()) >= min(CASES, 10) and tally["200"] and tally["400"], tally


texts = st.text(max_size=48)
int32 = st.integers(-(2**31), 2**31 - 1)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", ""]),
                                           "content": texts}), min_size=1, max_size=3)


FIELDS: dict[str, tuple[Any, Any]] = {  # field: (a strategy of sane values, one over the field's whole range)
    "prompt": (st.sampled_from(["Once upon a time", "Hi"]), st.none() | texts),
    "messages": (st.none(), st.none() | messages),
    "variant": (st.sampled_from(["", VARIANT]), texts),
    "max_new_tokens": (st.integers(1, 4), int32),
    "temperature": (st.sampled_from([0.0, 0.7, 1e-30]), floats32),
    "top_k": (st.integers(0, 50), int32),
    "top_p": (st.sampled_from([0.0, 0.9, 1.0]), floats32),
    "seed": (st.none() | st.integers(0, 2**63 - 1), st.integers(-2**63, 2**63 - 1)),
    "stop": (st.lists(st.text(min_size=1, max_size=8), max_size=3), st.lists(texts, max_size=20)),
    "stop_token_ids": (st.lists(st.integers(0, 49151), max_size=3), st.lists(int32, max_size=20)),
    "tau_min": (st.integers(0, 4), int32),
    "tau_max": (st.integers(0, 6), int32),
    "min_confidence": (st.none() | st.floats(0, 1), floats32),
    "min_block_tokens": (st.integers(0, 6), int32),
    "flush_interval_ms": (st.integers(0, 100), int32),
    "request_id": (st.just(""), st.text(max_size=140)),
    "ignore_eos": (st.booleans(), st.booleans()),
}


@st.composite
def generate_requests(draw: Any) -> pb.GenerateRequest:
    """A request whose fields are sane except a few drawn over their whole range (none, one or more)."""
    wild = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=3))
    kw = {name: draw(FIELDS[name][name in wild]) for name in FIELDS}
    n = kw["max_new_tokens"]
    kw["max_new_tokens"] = 4 if n == 0 else min(n, 4) if 0 < n <= 4096 else n  # 0 = 128: too long a case
    req = build_request(**kw)
    req.cycle.profile = draw(st.integers(0, 3) | st.integers(4, 2**31 - 1))  # open enum: unknown values travel
    return req


@st.composite
def corrupted(draw: Any) -> bytes:
    raw = bytearray(draw(generate_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            raw[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(raw)


def test_grpc_api_fuzzed_over_every_field_and_corrupt_bytes(stack, heartbeat):
    tally: Counter[str] = Counter()
    waits: list[float] = []
    channel = grpc.insecure_channel(stack.grpc_target)
    generate = channel.unary_stream("/dmtd.v1.GenerateService/Generate")

    @fuzz_settings
    @given(st.one_of(generate_requests().map(lambda m: m.SerializeToString()), corrupted(), st.binary(max_size=64)))
    def one(payload: bytes) -> None:
        sent = time.monotonic()
        call = generate(payload, timeout=60)
        try:
            for i, _ in enumerate(call):
                if i + 1 >= MAX_BLOCKS:
                    break
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        finally:
            call.cancel()
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
            (code, details, payload[:80])
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert FIELD_RULE.match(details), details
        waits.append(heartbeat.assert_advances(sent, budget(heartbeat)))
        tally[code.name] += 1

    try:
        one()
    finally:
        channel.close()
    report("grpc", tally, waits, heartbeat)
    assert sum(tally.values()) >= min(CASES, 10) and tally["OK"] and tally["INVALID_ARGUMENT"], tally


def report(api: str, tally: Counter[str], waits: list[float], heartbeat: Any) -> None:
    FUZZ_REPORT[api] = {"cases": sum(tally.values()), "outcomes": dict(sorted(tally.items())), "seed": SEED,
                        "stream_interval_median_ms": round(heartbeat.median_interval_s() * 1e3, 1),
                        "max_wait_for_next_block_ms": round(max(waits, default=0.0) * 1e3, 1)}
