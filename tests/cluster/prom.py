"""Debian's prometheus, scraping the serving pods as the chart's ServiceMonitor has it scrape the operator's
`<name>-metrics` Service: every serving pod's `metrics` port at /metrics, honouring the pods' own labels
(`deployment`), the Service's namespace as `namespace` (what prometheus-operator adds from Kubernetes SD)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.redis_proc import terminate


def scrape_config(namespace: str, deployment: str, targets: list[str], interval_s: float) -> dict[str, Any]:
    """The ServiceMonitor's one endpoint (helm/dmtd/templates/servicemonitor.yaml) as a plain scrape job."""
    return {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "scrape_configs": [{
            "job_name": f"serviceMonitor/{namespace}/dmtd/0",
            "honor_labels": True,
            "metrics_path": "/metrics",
            "scrape_timeout": f"{interval_s:g}s",
            "static_configs": [{"targets": targets, "labels": {"namespace": namespace, "deployment": deployment,
                                                               "service": f"{deployment}-metrics"}}],
        }],
    }


@dataclass
class PrometheusProcess:
    host: str
    port: int
    workdir: Path
    config: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> PrometheusProcess:
        exe = shutil.which("prometheus")
        assert exe is not None, "prometheus is missing (scripts/install-prometheus.sh installs it)"
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config))
        self.log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
                                      f"--web.listen-address={self.host}:{self.port}", "--log.level=warn",
                                      "--storage.tsdb.retention.time=2h"], stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}", timeout=10) as resp:
            return json.loads(resp.read())["data"]

    def series(self, promql: str, start: float, end: float, step_s: float = 2) -> list[float]:
        """The values of ``promql`` (one series) from ``start`` to ``end`` (epoch seconds)."""
        q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step_s})
        result = self.api(f"query_range?{q}")["result"]
        return [float(v) for _, v in result[0]["values"]] if result else []

    def target_health(self) -> dict[str, str]:
        """scrape URL → "up" / "down" of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def wait_targets_up(self, count: int, timeout_s: float) -> None:
        """Until ``count`` targets were scraped successfully (discovery and the first scrape take a moment)."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.target_health()
            if list(health.values()).count("up") >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus targets not up in {timeout_s} s: {health}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10)
            self.proc = None
            self.log.close()
