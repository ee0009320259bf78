"""API keys and TLS: a second gateway with keys and a certificate over the same replica (the `secure_stack`
fixture); the main stack has none, and behaves as before."""

from __future__ import annotations

import base64

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dmtd.client import DMTDClient
from dmtd.serve.auth import ApiKeys, AuthConfigError, key_from_header
from tests.serve.conftest import API_KEYS, VARIANT

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def test_grpc_needs_a_key_over_tls(secure_stack):
    for key in (None, "", "wrong-key", API_KEYS[0] + "x"):
        with DMTDClient(secure_stack.grpc_target, api_key=key or "", root_certificates=secure_stack.cert_pem) as c:
            with pytest.raises(grpc.RpcError) as e:
                list(c.generate(prompt="Hi", max_new_tokens=3))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                c.list_variants()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for key in API_KEYS:
        with DMTDClient(secure_stack.grpc_target, api_key=key, root_certificates=secure_stack.cert_pem) as c:
            blocks = list(c.generate(prompt="Hi", max_new_tokens=3, ignore_eos=True))
            assert sum(b.k for b in blocks) == 3 and [v.name for v in c.list_variants().variants] == [VARIANT]
    assert secure_stack.gateway_info()["block_sink"] is None  # block_push off: the blocks came through Serve
    with grpc.secure_channel(secure_stack.grpc_target, grpc.ssl_channel_credentials(secure_stack.cert_pem)) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no key
    with DMTDClient(secure_stack.grpc_target, api_key=API_KEYS[0]) as plain, pytest.raises(grpc.RpcError) as e:
        list(plain.generate(prompt="Hi", max_new_tokens=3, timeout_s=10))  # plaintext to a TLS port
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_http_and_dashboard_need_a_key(secure_stack, stack):
    url = secure_stack.http_url
    for path, method in [("/v1/models", "get"), ("/v1/chat/completions", "post"), ("/dashboard", "get"),
                         ("/dashboard/stats", "get"), ("/dashboard/assets/dashboard.js", "get")]:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic !!"}):
            r = requests.request(method, url + path, json=CHAT, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == ('Basic realm="dmtd"' if path.startswith("/dashboard")
                                                     else "Bearer")
    bearer = {"authorization": f"Bearer {API_KEYS[1]}"}
    assert requests.get(url + "/v1/models", headers=bearer, timeout=10).json()["data"][0]["id"] == VARIANT
    r = requests.post(url + "/v1/chat/completions", json=CHAT, headers=bearer, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    basic = {"authorization": "Basic " + base64.b64encode(f"anyone:{API_KEYS[0]}".encode()).decode()}
    assert requests.get(url + "/dashboard", headers=basic, timeout=10).status_code == 200  # a browser's way
    assert "series" in requests.get(url + "/dashboard/stats", headers=basic, timeout=10).json()
    assert requests.get(url + "/healthz", timeout=10).status_code == 200
    # without keys configured (the main stack) nothing changes
    assert requests.get(stack.http_url + "/v1/models", timeout=10).status_code == 200
    assert requests.get(stack.http_url + "/dashboard", timeout=10).status_code == 200


def test_keys_load_from_a_file_and_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# comment\nalpha\n\n  beta  \n")
    monkeypatch.setenv("DMTD_API_KEYS", "gamma, delta\nepsilon")
    keys = ApiKeys.load(str(f))
    assert all(keys.accepts(k) for k in ("alpha", "beta", "gamma", "delta", "epsilon"))
    assert not keys.accepts("comment") and not keys.accepts("") and not keys.accepts(None)
    monkeypatch.delenv("DMTD_API_KEYS")
    assert not ApiKeys.load().enabled and ApiKeys.load().accepts(None)  # no keys: open, as before
    with pytest.raises(AuthConfigError, match="api_keys_file"):
        ApiKeys.load(str(tmp_path / "missing"))
    assert key_from_header("Bearer abc") == "abc" and key_from_header("bearer  abc ") == "abc"
    assert key_from_header("Basic " + base64.b64encode(b"u:k:x").decode()) == "k:x"
    assert key_from_header("Token abc") is None and key_from_header("Basic ???") is None
