"""Observability of the platform: OpenTelemetry tracing and metrics (a Prometheus endpoint per serving
process), structured JSON logs, the cost model and the cost report. Imports no engine, Serve, Ray or gRPC.

Modules: ``config`` (settings, prices), ``tracing``, ``prometheus`` (the endpoint), ``instruments``,
``gateway`` / ``replica`` (the hooks the serving processes call), ``live`` (dashboard statistics),
``logs`` (JSON lines), ``system`` (CPU / NVML), ``cost`` (pure arithmetic), ``report`` (``dmtd cost report``).
Metric names live in ``dmtd_contract.metric_names`` (shared with the operator and the Grafana dashboard).
This package imports nothing on import, so the CLI stays quick.
"""
