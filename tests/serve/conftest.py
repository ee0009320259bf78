"""One Ray Serve stack for the serving tests (session-scoped), inside a private network namespace."""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dmtd.serve.local import prepare_environment, stop_log_monitor
from dmtd.serve.netns import isolate_network

VARIANT = "smol-d8"
FUZZ_REPORT: dict[str, dict[str, Any]] = {}  # filled by test_fuzz.py, printed at the end of the run
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


@dataclass
class Stack:
    grpc_target: str
    http_url: str  # the gateway's own HTTP server (what dmtd serve offers)
    app: str
    registry_url: str
    proxy_url: str = ""  # Serve's proxy (the secure stack's routes, under /secure)

    def replica_stats(self) -> dict[str, Any]:
        from ray import serve

        return serve.get_deployment_handle("DMTDReplica", app_name=self.app).stats.remote().result()

    def gateway_info(self) -> dict[str, Any]:
        from ray import serve

        return serve.get_deployment_handle("Gateway", app_name=self.app).info.remote().result()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_registry(workdir) -> tuple[object, str]:
    """A Debian redis-server on loopback of this (private) namespace, with the served variant registered."""
    from dmtd_contract.registry import RegistryClient, VariantSpec
    from tests.registry.conftest import INSTALL_HINT, _start, system_redis_server

    exe = system_redis_server()
    if exe is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    proc, url = _start(exe, workdir)
    with RegistryClient(url) as reg:
        reg.register(VariantSpec(name=VARIANT, num_thinking_layers=22, num_decoding_layers=8, tau_min=1, tau_max=4,
                                 default_tau=1, min_confidence=0.0, verifier="base"), status="active",
                     traffic_weight=1.0)
        reg.set_default(VARIANT)
    return proc, url


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    isolate_network()  # first: Redis and Ray below must live on this namespace's loopback
    redis_proc, registry_url = start_registry(tmp_path_factory.mktemp("serve-redis"))
    prepare_environment(60.0)  # as dmtd serve: Serve's gRPC on loopback, Ray's bookkeeping off, ...
    import ray
    from ray import serve

    from dmtd.serve.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="dmtd-tests")
    stop_log_monitor()
    http_port, grpc_port, proxy_port = free_port(), free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    app = build_app({
        # float32: the exact-profile streams are checked against float32 references token for token
        "variants": [{"name": VARIANT, "variant": "none", "decoding_layers": 8, "tau_max": 4, "dtype": "float32"}],
        "drafts": "fixed",  # the exact-profile tests below watch drafts being made, checked and counted
        "grpc_port": grpc_port, "http_port": http_port, "max_num_seqs": 8, "max_queued": 4, "max_inflight": 10,
        "max_model_len": 1024,
        "registry_url": registry_url, "itl_slo_ms": 5000.0,  # no ITL pressure: tests see the operating point
        "omp_wait_policy": "PASSIVE",  # the replica shares 2 cores with the test process, Ray and the gateway
    })
    serve.run(app, name="dmtd", route_prefix="/")
    serve.get_deployment_handle("Gateway", app_name="dmtd").wait_ready.remote(600).result()  # its warm-up done
    yield Stack(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", "dmtd", registry_url,
                f"http://127.0.0.1:{proxy_port}")
    serve.shutdown()
    ray.shutdown()
    redis_proc.terminate()  # type: ignore[attr-defined]


API_KEYS = ("key-one-3f9a", "key-two-77c1")


@dataclass
class SecureStack:
    grpc_target: str  # TLS; the certificate names localhost
    http_url: str
    cert_pem: bytes
    gateway: Any = None  # its Serve handle

    def gateway_info(self) -> dict[str, Any]:
        return dict(self.gateway.info.remote().result())


@pytest.fixture(scope="session")
def secure_stack(stack, tmp_path_factory):
    """A second gateway over the same replica, with API keys and gRPC TLS: its own Serve app at /secure. Its
    blocks come back as items of the Serve call (``block_push`` off), the path the main stack's sink bypasses."""
    from ray import serve

    from dmtd.serve.app import GatewayIngress

    d = tmp_path_factory.mktemp("secure")
    keys, cert, key = d / "api-keys", d / "cert.pem", d / "key.pem"
    keys.write_text(f"# one key a line\n{API_KEYS[0]}\n\n{API_KEYS[1]}\n")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    replica = serve.get_deployment_handle("DMTDReplica", app_name=stack.app)
    gateway: Any = serve.deployment(GatewayIngress, name="Gateway", num_replicas=1,
                                    ray_actor_options={"num_cpus": 0})
    app = gateway.bind({VARIANT: replica}, [{"name": VARIANT, "status": "active", "traffic_weight": 1.0}], VARIANT,
                       "127.0.0.1", port, 10, None, None, None, None, str(keys), str(cert), str(key), "off")
    serve.run(app, name="dmtd-secure", route_prefix="/secure")
    serve.get_deployment_handle("Gateway", app_name="dmtd-secure").wait_ready.remote(600).result()
    yield SecureStack(f"localhost:{port}", stack.proxy_url + "/secure", cert.read_bytes(),
                      serve.get_deployment_handle("Gateway", app_name="dmtd-secure"))
    serve.delete("dmtd-secure")


@pytest.fixture
def heartbeat(stack):
    """A stream kept in flight for the whole test (tests.serve.heartbeat)."""
    from tests.serve.heartbeat import Heartbeat

    with Heartbeat(stack.grpc_target) as hb:
        yield hb
    from tests.serve.test_stack import wait_idle

    wait_idle(stack, 30)


def pytest_terminal_summary(terminalreporter) -> None:
    if not FUZZ_REPORT:
        return
    terminalreporter.section("hostile-input fuzzing")
    for api, r in FUZZ_REPORT.items():
        terminalreporter.write_line(f"{api}: {r['cases']} cases (seed {r['seed']}) {r['outcomes']}; in-flight stream: "
                                    f"median block interval {r['stream_interval_median_ms']} ms, longest wait for "
                                    f"its next block after a case {r['max_wait_for_next_block_ms']} ms")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "fuzz.json").write_text(json.dumps(FUZZ_REPORT, indent=2))
