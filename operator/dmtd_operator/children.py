"""Idempotent create-or-patch of the owned objects, and API errors mapped to kopf's retry policy.

`ensure` can run any number of times, from any operator instance, after any crash: it creates what is
missing (a concurrent create turns into a patch), patches only what differs from the rendering, and
never deletes and re-creates. So a restart mid-reconcile converges without duplicates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import kopf

from dmtd_operator import render
from dmtd_operator import resources as r
from dmtd_operator.kube import ApiError, Body, ConflictError, KubeApi, NotFoundError, ObjectRef


def owner_reference(name: str, uid: str) -> Body:
    """Makes the DMTDDeployment the controller of a child (Kubernetes GC deletes children with it)."""
    return {
        "apiVersion": r.API_VERSION,
        "kind": r.KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def ref_of(body: Body) -> ObjectRef:
    """Where a rendered object lives."""
    plural = {"RayService": r.RAY_SERVICE_PLURAL, "Service": "services", "ConfigMap": "configmaps"}[
        body["kind"]
    ]
    meta = body["metadata"]
    return ObjectRef(body["apiVersion"], plural, meta["namespace"], meta["name"])


def contains(live: Any, desired: Any) -> bool:
    """True when every field of `desired` is present in `live` with the same value (lists: same length)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return bool(live == desired)


def _drift(live: Body, desired: Body) -> Body:
    """The merge patch that brings `live` to `desired`: changed top-level spec keys and labels/owners."""
    patch: Body = {}
    meta = {k: desired["metadata"][k] for k in ("labels", "ownerReferences") if k in desired["metadata"]}
    if not contains(live.get("metadata", {}), meta):
        patch["metadata"] = meta
    spec = {k: v for k, v in desired.get("spec", {}).items() if not contains(live.get("spec", {}).get(k), v)}
    if spec:
        patch["spec"] = spec
    return patch


async def ensure(api: KubeApi, desired: Body) -> tuple[Body, str]:
    """Create or patch `desired`; returns the live object and what was done (created/patched/unchanged)."""
    ref = ref_of(desired)
    live = await api.get(ref)
    if live is None:
        try:
            return await api.create(ref, desired), "created"
        except ConflictError:
            live = await api.get(ref)
            if live is None:
                raise kopf.TemporaryError(
                    f"{ref.plural}/{ref.name} conflicts but is gone; retrying", delay=1
                ) from None
    patch = _drift(live, desired)
    if not patch:
        return live, "unchanged"
    return await api.patch(ref, patch), "patched"


async def apply_all(api: KubeApi, target: render.Target) -> tuple[Body, dict[str, str]]:
    """Ensure the RayService and both Services; returns the live RayService and the actions taken."""
    actions: dict[str, str] = {}
    live_rs: Body = {}
    for body in (render.ray_service(target), render.gateway_service(target), render.metrics_service(target)):
        live, action = await ensure(api, body)
        actions[f"{body['kind']}/{body['metadata']['name']}"] = action
        if body["kind"] == r.RAY_SERVICE_KIND:
            live_rs = live
    return live_rs, actions


async def delete_all(api: KubeApi, namespace: str, name: str) -> list[str]:
    """Delete every child of DMTDDeployment `name`; returns those that existed."""
    refs = [
        ObjectRef(r.RAY_API_VERSION, r.RAY_SERVICE_PLURAL, namespace, r.ray_service_name(name)),
        ObjectRef("v1", "services", namespace, r.gateway_service_name(name)),
        ObjectRef("v1", "services", namespace, r.metrics_service_name(name)),
    ]
    return [f"{ref.plural}/{ref.name}" for ref in refs if await api.delete(ref)]


def ready_replicas(live_rs: Body, desired: int) -> int:
    """Serving replicas according to KubeRay: all when the Serve deployment is HEALTHY, else ready workers."""
    status = live_rs.get("status") or {}
    active = status.get("activeServiceStatus") or {}
    app = (active.get("applicationStatuses") or {}).get(r.SERVE_APP_NAME) or {}
    dep = (app.get("serveDeploymentStatuses") or {}).get(r.REPLICA_DEPLOYMENT) or {}
    if dep.get("status") == "HEALTHY":
        return desired
    workers = (active.get("rayClusterStatus") or {}).get("readyWorkerReplicas")
    return min(int(workers), desired) if isinstance(workers, int) else 0


@asynccontextmanager
async def api_errors(what: str) -> AsyncIterator[None]:
    """Map API failures to kopf's retry policy: transient ones retry, invalid ones stop."""
    try:
        yield
    except NotFoundError as e:
        raise kopf.TemporaryError(f"{what}: {e} (is KubeRay installed?)", delay=30) from e
    except ConflictError as e:
        raise kopf.TemporaryError(f"{what}: conflict, retrying: {e}", delay=1) from e
    except ApiError as e:
        if e.status in (400, 422):
            raise kopf.PermanentError(f"{what}: the API rejected the object: {e}") from e
        if e.status in (401, 403):
            raise kopf.TemporaryError(
                f"{what}: not allowed (check the operator's RBAC): {e}", delay=60
            ) from e
        raise kopf.TemporaryError(f"{what}: {e}", delay=10) from e
    except (aiohttp.ClientError, TimeoutError) as e:
        raise kopf.TemporaryError(f"{what}: API unreachable: {e}", delay=10) from e
