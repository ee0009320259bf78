"""An OpenTelemetry MeterProvider read by a Prometheus endpoint of this process (its own registry and port).

Instrument names are the Prometheus names of ``dmtd_contract.metric_names`` (the exporter appends nothing
they do not already end with), histogram buckets come from views, scope labels and ``target_info`` are off
so the exposition carries exactly our labels.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from dmtd_contract import metric_names as m

log = logging.getLogger("dmtd.telemetry")

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                     1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
BLOCK_BUCKETS = tuple(float(k) for k in range(1, 9))
ACCEPTED_BUCKETS = tuple(float(k) for k in range(0, m.MAX_DRAFT_POSITION + 1))
GPU_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
BUCKETS: dict[str, tuple[float, ...]] = {
    m.TTFT_SECONDS.name: LATENCY_BUCKETS_S, m.ITL_SECONDS.name: LATENCY_BUCKETS_S,
    m.E2E_SECONDS.name: LATENCY_BUCKETS_S, m.BLOCK_LENGTH.name: BLOCK_BUCKETS,
    m.REQUEST_GPU_SECONDS.name: GPU_SECONDS_BUCKETS, m.ACCEPTED_PER_CYCLE.name: ACCEPTED_BUCKETS,
}


class MetricsEndpoint:
    """A MeterProvider whose metrics this process serves at ``http://host:port/metrics``."""

    def __init__(self, service: str, port: int | None, host: str = "127.0.0.1", port_tries: int = 32) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False,
                                             registry=self.registry)
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(b)))
                 for name, b in BUCKETS.items()]
        self.provider = MeterProvider(metric_readers=[self.reader], views=views,
                                      resource=Resource.create({"service.name": service}))
        self.meter = self.provider.get_meter("dmtd")
        self.host = host
        self.port: int | None = None
        self._server: Any = None
        if port is not None:
            self._serve(host, port, port_tries)

    def _serve(self, host: str, port: int, tries: int) -> None:
        for p in [port + i for i in range(tries)] if port else [0]:
            try:
                self._server, _thread = start_http_server(p, addr=host, registry=self.registry)
                self.port = int(self._server.server_port)
                return
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
        log.warning("no free metrics port in %d..%d; metrics are not served", port, port + tries - 1)

    @property
    def url(self) -> str | None:
        return f"http://{self.host}:{self.port}/metrics" if self.port else None

    def exposition(self) -> str:
        """The text a scrape would return now."""
        return generate_latest(self.registry).decode()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.provider.shutdown()
