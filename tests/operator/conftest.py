"""Fixtures of the operator tests: a kmock API server and a kopf runner for our handlers."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if importlib.util.find_spec("dmtd_operator") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT / "operator"))
if str(HERE) not in sys.path:  # the helper modules beside the tests, whatever the import mode
    sys.path.insert(0, str(HERE))

from kube_emulator import KubeEmulator  # noqa: E402


@pytest.fixture
def k8s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeEmulator]:
    """kmock serving the Kubernetes API over HTTP; KUBECONFIG points at it; fast operator settings."""
    with KubeEmulator() as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setenv("DMTD_METRICS_SOURCE", "annotation")
        monkeypatch.setenv("DMTD_RECONCILE_INTERVAL_S", "0.3")
        monkeypatch.setenv("DMTD_REGISTRY_URL", "redis://dmtd-redis.dmtd:6379/0")
        monkeypatch.delenv("DMTD_PROMETHEUS_URL", raising=False)
        yield emulator
