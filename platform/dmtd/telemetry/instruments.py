"""The metrics of ``dmtd_contract.metric_names``: one place creates them all.

Counters and histograms are kept here and read at scrape time by a collector on the endpoint's Prometheus registry:
an ``add`` or a ``record`` is a dict update and a bisect under a lock (~3 µs), where the OpenTelemetry SDK's
synchronous instruments took ~20 µs a call — at 16 streams the gateway and a replica made ~1,500 such calls a
second, ~3 % of a core beside an engine on two. Gauges (read at scrape time anyway) go through OpenTelemetry's
observable instruments, into the same exposition.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Iterator

from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from dmtd.telemetry.prometheus import BUCKETS, MetricsEndpoint
from dmtd_contract import metric_names as m

Labels = dict[str, str]
Reading = Callable[[], Iterable[tuple[float, Labels]]]
_Key = tuple[tuple[str, str], ...]  # a series' labels, sorted by name


class _Histogram:
    """Per-bucket counts (not cumulative), the sum and the count of one series."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0


class Instruments:
    """The metrics of one process for one ``source`` (gateway or replica), every series carrying ``base``'s labels."""

    def __init__(self, endpoint: MetricsEndpoint, source: m.Source, base: Labels) -> None:
        self.meter, self.source, self.base = endpoint.meter, source, dict(base)
        self._metrics = {metric.name: metric for metric in m.ALL if metric.source == source}
        self._lock = threading.Lock()
        self._counters: dict[str, dict[_Key, float]] = {}
        self._histograms: dict[str, dict[_Key, _Histogram]] = {}
        self._bounds: dict[str, tuple[float, ...]] = {}
        self._observed: dict[str, Reading] = {}
        for metric in self._metrics.values():
            if metric.kind == "counter":
                # a zero series from the start where the base labels are all it has: rate() and absence checks work
                self._counters[metric.name] = {self._key({}): 0.0} if set(metric.labels) <= set(base) else {}
            elif metric.kind == "histogram":
                self._histograms[metric.name] = {}
                self._bounds[metric.name] = BUCKETS[metric.name]
        endpoint.registry.register(_Collector(self))

    def labels(self, **extra: str) -> Labels:
        return {**self.base, **extra}

    def _key(self, extra: Labels) -> _Key:
        return tuple(sorted({**self.base, **extra}.items()))

    def add(self, metric: m.MetricName, value: float, **labels: str) -> None:
        key = self._key(labels)
        series = self._counters[metric.name]
        with self._lock:
            series[key] = series.get(key, 0.0) + value

    def record(self, metric: m.MetricName, value: float, **labels: str) -> None:
        self.record_n(metric, value, 1, labels)

    def record_n(self, metric: m.MetricName, value: float, count: int, labels: Labels) -> None:
        """``count`` observations of ``value`` at once (a block of k tokens: k of its gap / k)."""
        key = self._key(labels)
        series = self._histograms[metric.name]
        i = bisect.bisect_left(self._bounds[metric.name], value)  # the bucket whose bound is the first >= value
        with self._lock:
            h = series.get(key)
            if h is None:
                h = series[key] = _Histogram(len(self._bounds[metric.name]))
            h.counts[i] += count
            h.sum += value * count
            h.count += count

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

    def families(self) -> Iterator[Metric]:
        """The counters and histograms as Prometheus metric families (what a scrape reads)."""
        with self._lock:
            counters = {name: dict(series) for name, series in self._counters.items() if series}
            histograms = {name: {k: (list(h.counts), h.sum, h.count) for k, h in series.items()}
                          for name, series in self._histograms.items() if series}
        for name, values in counters.items():
            fam = CounterMetricFamily(name, self._metrics[name].help)
            for key, v in values.items():
                fam.add_sample(fam.name + "_total", dict(key), v)
            yield fam
        for name, hists in histograms.items():
            les = [floatToGoString(b) for b in self._bounds[name]] + ["+Inf"]
            hist = HistogramMetricFamily(name, self._metrics[name].help)
            for key, (counts, total, count) in hists.items():
                acc = 0
                for le, c in zip(les, counts):
                    acc += c
                    hist.add_sample(name + "_bucket", {**dict(key), "le": le}, float(acc))
                hist.add_sample(name + "_count", dict(key), float(count))
                hist.add_sample(name + "_sum", dict(key), total)
            yield hist


class _Collector:
    """A Prometheus collector over one :class:`Instruments`' counters and histograms."""

    def __init__(self, ins: Instruments) -> None:
        self.ins = ins

    def collect(self) -> Iterator[Metric]:
        return self.ins.families()
