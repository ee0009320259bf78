"""The container images under test: whether podman can run them here, and how the tests start them.

`make test` builds the images first (`make images`); pytest alone uses what is built and skips, naming the
reason, where podman cannot run or an image is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PODMAN = [str(ROOT / "scripts" / "podman.sh")]
CHART = ROOT / "helm" / "dmtd"


def chart_tag() -> str:
    """The chart's appVersion: the tag `make images` gives both images."""
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def image_name(kind: str) -> str:
    return f"ghcr.io/dmtd/{kind}:{chart_tag()}"


def podman_unavailable() -> str | None:
    """Why podman cannot run containers here, or None."""
    if shutil.which("podman") is None or not Path("/usr/sbin/runc").exists():
        return "podman or runc is not installed (scripts/install-podman.sh installs them; make images runs it)"
    if os.geteuid() != 0:
        return "podman with runc runs as root here; the tests run as a user"
    probe = subprocess.run([*PODMAN, "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode != 0:
        return f"podman info failed: {probe.stderr.strip()[-300:]}"
    return None


def image_missing(name: str) -> str | None:
    if subprocess.run([*PODMAN, "image", "exists", name], timeout=60).returncode != 0:
        return f"image {name} is not built (make images builds it)"
    return None


@dataclass
class Container:
    """One `podman run -d` on the host network of this (private) namespace; removed on `stop`."""

    image: str
    args: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    id: str = ""

    def start(self) -> Container:
        out = subprocess.run([*PODMAN, "run", "-d", "--network", "host", *self.args, self.image, *self.command],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        self.id = out.stdout.strip()
        return self

    def running(self) -> bool:
        out = subprocess.run([*PODMAN, "inspect", "-f", "{{.State.Running}}", self.id], capture_output=True,
                             text=True, timeout=60)
        return out.stdout.strip() == "true"

    def logs(self) -> str:
        out = subprocess.run([*PODMAN, "logs", self.id], capture_output=True, text=True, timeout=60)
        return (out.stdout + out.stderr)[-6000:]

    def stop(self) -> None:
        if self.id:
            subprocess.run([*PODMAN, "rm", "-f", "-t", "5", self.id], capture_output=True, timeout=120)


def run_in(image: str, args: list[str], command: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`podman run --rm` without a network, and wait for it."""
    return subprocess.run([*PODMAN, "run", "--rm", "--network", "none", *args, image, *command],
                          capture_output=True, text=True, timeout=timeout)
