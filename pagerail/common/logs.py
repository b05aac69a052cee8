"""Log lines as text or JSON, carrying the request id and the current trace id when there is one."""

from __future__ import annotations

import json
import logging
import os
import time

LOG_FORMAT_ENV = "PAGERAIL_LOG_FORMAT"


def _trace_id() -> str | None:
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and request_id / trace_id when known."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        trace_id = getattr(record, "trace_id", None) or _trace_id()
        if trace_id is not None:
            entry["trace_id"] = trace_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str | None = None, level: str = "INFO") -> None:
    """Set the root handler once; `log_format` "json" or "text" (default: $PAGERAIL_LOG_FORMAT, else text)."""
    log_format = (log_format or os.environ.get(LOG_FORMAT_ENV) or "text").lower()
    if log_format not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {log_format!r}")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
