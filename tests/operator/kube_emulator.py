"""A kmock Kubernetes API emulator on a real HTTP port, in a background thread, for sync tests.

kopf (via KopfRunner) talks to it over HTTP like to a cluster; tests create/patch/delete objects with
`request()` and read the emulator's in-memory state with `objects()`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml

T = TypeVar("T")

RESOURCES: dict[str, kmock.ResourceInfo] = {
    "serving.dmtd.dev/v1alpha1/dmtddeployments": kmock.ResourceInfo(
        kind="DMTDDeployment",
        singular="dmtddeployment",
        namespaced=True,
        shortnames={"dmtd"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status"},
    ),
    "ray.io/v1/rayservices": kmock.ResourceInfo(
        kind="RayService",
        singular="rayservice",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status"},
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service",
        singular="service",
        namespaced=True,
        verbs={"get", "list", "create", "patch", "delete"},
    ),
    "v1/configmaps": kmock.ResourceInfo(
        kind="ConfigMap",
        singular="configmap",
        namespaced=True,
        verbs={"get", "list", "create", "patch", "delete"},
    ),
    "v1/events": kmock.ResourceInfo(kind="Event", singular="event", namespaced=True, verbs={"create"}),
    # Always present in a real cluster; kopf's startup waits for them to be discoverable.
    "v1/namespaces": kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs={"get", "list", "watch"}
    ),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition",
        singular="customresourcedefinition",
        namespaced=False,
        verbs={"get", "list", "watch"},
    ),
}


class KubeEmulator:
    """Start with `with KubeEmulator() as k8s:`; `k8s.url` is the API server address."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.handler: kmock.KubernetesEmulator | None = None
        self.url = ""

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as handler, kmock.Server(handler, host=self.host) as server:
            for key, info in RESOURCES.items():
                handler.resources[key] = info
            self.handler = handler
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> KubeEmulator:
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        if not self._ready.wait(10):
            raise RuntimeError(f"kmock did not start: {self._task.exception(0)}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._task.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the emulator's loop thread (safe access to its state)."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "kmock",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "kmock", "user": {"token": "test-token"}}],
                    "contexts": [
                        {
                            "name": "kmock",
                            "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"},
                        }
                    ],
                }
            )
        )
        return path

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        ctype = "application/merge-patch+json" if method == "PATCH" else "application/json"
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": ctype}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            raw = e.read()
            return e.code, json.loads(raw) if raw else None

    def objects(self, resource: str, namespace: str = "default") -> dict[str, dict[str, Any]]:
        """Live (not deleted) objects of `resource` in `namespace`, by name, as plain dicts."""

        def read() -> dict[str, dict[str, Any]]:
            assert self.handler is not None
            out: dict[str, dict[str, Any]] = {}
            for (res, ns, name), obj in list(self.handler.objects.items()):
                key = f"{res.group}/{res.version}/{res.plural}".lstrip("/")
                if key == resource and ns == namespace and not obj.deleted:
                    out[name] = json.loads(json.dumps(obj.raw))
            return out

        return self.call(read)

    def count_requests(self, method: str, path_part: str) -> int:
        """How many requests with `method` had `path_part` in their path."""

        def read() -> int:
            assert self.handler is not None
            return sum(
                1
                for rq in list(self.handler)
                if str(rq.method.value).upper() == method and path_part in rq.url.path
            )

        return self.call(read)

    def wait_for(self, probe: Callable[[], T | None], timeout_s: float = 20.0, interval_s: float = 0.1) -> T:
        """Poll `probe` until it returns something truthy; fail with its last value otherwise."""
        deadline = time.monotonic() + timeout_s
        last: T | None = None
        while time.monotonic() < deadline:
            last = probe()
            if last:
                return last
            time.sleep(interval_s)
        raise AssertionError(f"condition not met within {timeout_s}s; last value: {last!r}")
