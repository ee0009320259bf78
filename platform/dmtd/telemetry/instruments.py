"""OpenTelemetry instruments named by ``dmtd_contract.metric_names``: one place creates them all."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from dmtd_contract import metric_names as m

Labels = dict[str, str]
Reading = Callable[[], Iterable[tuple[float, Labels]]]


class Instruments:
    """Instruments of one process for the metrics of one ``source`` (gateway or replica)."""

    def __init__(self, meter: Meter, source: m.Source, base: Labels) -> None:
        self.meter, self.source, self.base = meter, source, dict(base)
        self._sync: dict[str, Any] = {}
        self._observed: dict[str, Reading] = {}
        for metric in m.ALL:
            if metric.source != source:
                continue
            if metric.kind == "counter":
                self._sync[metric.name] = meter.create_counter(metric.name, unit=metric.unit,
                                                               description=metric.help)
                if set(metric.labels) <= set(base):  # a zero series from the start: rate() and absence checks work
                    self._sync[metric.name].add(0, self.base)
            elif metric.kind == "histogram":
                self._sync[metric.name] = meter.create_histogram(metric.name, unit=metric.unit,
                                                                 description=metric.help)

    def labels(self, **extra: str) -> Labels:
        return {**self.base, **extra}

    def add(self, metric: m.MetricName, value: float, **labels: str) -> None:
        self._sync[metric.name].add(value, self.labels(**labels))

    def record(self, metric: m.MetricName, value: float, **labels: str) -> None:
        self._sync[metric.name].record(value, self.labels(**labels))

    def observe(self, metric: m.MetricName, reading: Reading) -> None:
        """A gauge (or monotonic counter) read at scrape time; ``reading`` yields (value, extra labels)."""
        assert metric.source == self.source and metric.name not in self._observed, metric.name

        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            try:
                return [Observation(v, self.labels(**lab)) for v, lab in reading()]
            except Exception:  # a failing reading must not break the whole scrape
                return []

        self._observed[metric.name] = reading
        if metric.kind == "counter":
            self.meter.create_observable_counter(metric.name, [callback], unit=metric.unit, description=metric.help)
        else:
            self.meter.create_observable_gauge(metric.name, [callback], unit=metric.unit, description=metric.help)
