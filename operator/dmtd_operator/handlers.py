"""kopf handlers for DMTDDeployment. Run: `kopf run --standalone --all-namespaces -m dmtd_operator.handlers`.

Thin by design: each handler fetches the runtime from `kopf.Memo`, calls `dmtd_operator.reconcile`, and
writes the returned status through `patch`. Errors are typed by retry policy in `children.api_errors`.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from dmtd_operator import reconcile
from dmtd_operator import resources as r
from dmtd_operator.config import OperatorConfig
from dmtd_operator.runtime import MEMO_KEY, build_runtime, credentials_of, runtime_of

CONFIG = OperatorConfig.from_env()
"""Read at import: the timer interval must be known when the decorators run."""


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Least-privilege kopf settings and the shared runtime."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=r.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=r.GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = r.FINALIZER
    settings.scanning.disabled = True  # no cluster-wide CRD/namespace watching: fewer RBAC rights
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    memo[MEMO_KEY] = build_runtime(CONFIG, credentials_of(memo))
    logger.info("dmtd operator configured: %s", CONFIG.model_dump())


@kopf.on.login()
def login(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else the kubeconfig; the children's client reuses the same credentials."""
    info = kopf.login_with_service_account(settings=settings, **kwargs) or kopf.login_with_kubeconfig(
        settings=settings, **kwargs
    )
    credentials_of(memo).info = info
    return info


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    rt = memo.get(MEMO_KEY)
    if rt is not None:
        await rt.metrics.close()
        close_api = getattr(rt.api, "close", None)
        if close_api is not None:
            await close_api()


@kopf.on.resume(r.GROUP, r.VERSION, r.PLURAL)
@kopf.on.create(r.GROUP, r.VERSION, r.PLURAL)
@kopf.on.update(r.GROUP, r.VERSION, r.PLURAL, field="spec")
async def reconcile_spec(
    name: str | None,
    namespace: str | None,
    uid: str | None,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Render the RayService, gateway and metrics Services and the registry entry at the scale in force."""
    assert name is not None and namespace is not None
    rt = runtime_of(memo)
    generation = int(meta.get("generation") or 0)
    new_status = await reconcile.reconcile(rt, name, namespace, uid or "", generation, spec, status)
    patch.status.update(new_status)
    logger.info("reconciled %s/%s at %s replicas", namespace, name, new_status["desiredReplicas"])


@kopf.timer(r.GROUP, r.VERSION, r.PLURAL, interval=CONFIG.reconcile_interval_s, initial_delay=1.0)
async def autoscale(
    name: str | None,
    namespace: str | None,
    uid: str | None,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Metrics window -> policy decision -> children and status."""
    assert name is not None and namespace is not None
    rt = runtime_of(memo)
    try:
        new_status = await reconcile.autoscale(rt, name, namespace, uid or "", spec, status, meta.annotations)
    except kopf.PermanentError as e:
        # The spec handler has already reported it; repeating it every interval is noise.
        logger.debug("not autoscaling %s/%s: %s", namespace, name, e)
        return
    if new_status is None:
        return
    patch.status.update(new_status)
    decision = new_status["lastDecision"]
    previous = (status.get("desiredReplicas"), (status.get("tau") or {}).get("max"))
    if (decision["replicas"], decision["tauMax"]) != previous:
        logger.info("%s/%s: %s", namespace, name, decision["reason"])


@kopf.on.delete(r.GROUP, r.VERSION, r.PLURAL)
async def delete(
    name: str | None, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Remove the children and the registry entry before the finalizer is released."""
    assert name is not None and namespace is not None
    deleted = await reconcile.cleanup(runtime_of(memo), name, namespace)
    logger.info("deleted %s/%s children: %s", namespace, name, ", ".join(deleted) or "none left")
