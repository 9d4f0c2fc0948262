"""Process logging: text or JSON lines on stderr, each line about a request carrying its ids.

`setup_logging(service)` is called once by each process's entry point. The format comes from
`$MOEBUS_LOG_FORMAT` (`text`, the default, or `json`; `moebus up --log-format json` sets it for
every process it starts). A line logged while a request is being handled carries that request's
id (`request_id`, set with `request_scope`) and trace id (the current OpenTelemetry span's, when
tracing is on); `extra={...}` fields of a record (the access log's) become JSON keys, or
`key=value` pairs after the text message.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import orjson

from .tracing import current_trace_id

LOG_FORMAT_ENV = "MOEBUS_LOG_FORMAT"
FORMATS = ("text", "json")
# The request being handled by this task (and the tasks it starts): logging's context, read by the
# filter below; asyncio copies it into every task, so it never leaks across requests.
_REQUEST_ID: ContextVar[str | None] = ContextVar("moebus_request_id", default=None)
# LogRecord attributes that are not `extra` fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "service",
                                                                             "request_id", "trace_id"}


@contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Lines logged inside (this task and tasks it starts) name `request_id`."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def current_request_id() -> str | None:
    return _REQUEST_ID.get()


class RequestContext(logging.Filter):
    """Adds `service`, `request_id` and `trace_id` to every record (None outside a request); a
    record may carry its own (the access log's, written after the request's scope ended)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        if getattr(record, "trace_id", None) is None:
            record.trace_id = current_trace_id()
        return True


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, logger, msg, request_id, trace_id, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "service": getattr(record, "service", None), "logger": record.name,
            "msg": record.getMessage(), "request_id": getattr(record, "request_id", None),
            "trace_id": getattr(record, "trace_id", None), **extra_fields(record)}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """The classic line, then ` request_id=.. trace_id=..` when about a request, then extra fields."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        pairs = {"request_id": getattr(record, "request_id", None), "trace_id": getattr(record, "trace_id", None),
                 **extra_fields(record)}
        tail = " ".join(f"{k}={v}" for k, v in pairs.items() if v is not None)
        if not tail:
            return line
        head, sep, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {tail}{sep}{rest}"


def setup_logging(service: str, fmt: str | None = None, level: int = logging.INFO) -> None:
    """Root logging for this process (replaces earlier handlers)."""
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "text").lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(service))
    handler.addFilter(RequestContext(service))
    logging.basicConfig(level=level, handlers=[handler], force=True)
