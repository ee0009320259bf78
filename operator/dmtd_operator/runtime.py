"""The operator's dependencies, built once at startup and shared through `kopf.Memo`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import kopf

from dmtd_operator.config import OperatorConfig
from dmtd_operator.kube import HttpKubeApi, KubeApi
from dmtd_operator.metrics import AnnotationMetricsSource, MetricsSource, NullMetricsSource
from dmtd_operator.prometheus import PrometheusMetricsSource
from dmtd_operator.registry import ConfigMapRegistry, NullRegistry, RedisRegistry, RegistryWriter

MEMO_KEY = "dmtd"


@dataclass(slots=True)
class Credentials:
    """The latest connection info returned by the login handler."""

    info: kopf.ConnectionInfo | None = None


@dataclass(slots=True)
class Runtime:
    """Everything a handler needs; tests build one with fakes, production with `build_runtime`."""

    config: OperatorConfig
    api: KubeApi
    metrics: MetricsSource
    registry: RegistryWriter
    clock: Callable[[], float] = time.time
    credentials: Credentials = field(default_factory=Credentials)


def build_runtime(config: OperatorConfig, credentials: Credentials) -> Runtime:
    """The production wiring for `config`."""
    api = HttpKubeApi(lambda: credentials.info, timeout_s=config.api_timeout_s)
    metrics: MetricsSource
    if config.metrics_source == "prometheus":
        metrics = PrometheusMetricsSource(config.prometheus_url)
    elif config.metrics_source == "annotation":
        metrics = AnnotationMetricsSource()
    else:
        metrics = NullMetricsSource()
    registry: RegistryWriter
    if config.registry_writer == "redis":
        registry = RedisRegistry(config.registry_url, mirror=ConfigMapRegistry(api))
    elif config.registry_writer == "configmap":
        registry = ConfigMapRegistry(api)
    else:
        registry = NullRegistry()
    return Runtime(config=config, api=api, metrics=metrics, registry=registry, credentials=credentials)


def credentials_of(memo: kopf.Memo) -> Credentials:
    """The credentials holder in `memo`, created on first use (login may run before startup)."""
    holder = memo.get("credentials")
    if not isinstance(holder, Credentials):
        holder = Credentials()
        memo["credentials"] = holder
    return holder


def runtime_of(memo: kopf.Memo) -> Runtime:
    """The Runtime that the startup handler stored in `memo`."""
    rt = memo.get(MEMO_KEY)
    if not isinstance(rt, Runtime):
        raise kopf.TemporaryError("operator runtime not initialised yet", delay=1)
    return rt
