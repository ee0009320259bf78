"""Structured JSON logs: one object per line, carrying ``request_id`` and the ``trace_id`` of its trace."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from opentelemetry import trace

RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "trace_id", "span_id", ...extra fields}``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                               + f".{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"], out["span_id"] = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        out.update({k: v for k, v in record.__dict__.items() if k not in RESERVED and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_json_logging(logger_name: str = "dmtd", stream: TextIO | None = None,
                           level: int = logging.INFO) -> logging.Handler:
    """Send ``logger_name``'s records, as JSON lines, to ``stream`` (stderr); idempotent per logger."""
    logger = logging.getLogger(logger_name)
    for h in logger.handlers:
        if isinstance(h.formatter, JsonFormatter):
            return h
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler
