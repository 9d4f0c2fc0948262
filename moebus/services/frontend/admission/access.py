"""One access-log line per HTTP request, and its request id.

Every request gets an id: the client's `X-Request-Id` when it sends a usable one (printable ASCII,
at most 128 characters), else a fresh one; the response (errors and streams too) carries it back
in `X-Request-Id`, and every log line written while the request is handled names it
(shared/logs.py). When the request ends the `moebus.access` logger writes one line: method, path,
status, prompt and completion tokens, time to first token, total time, request id, trace id and,
for 4xx/5xx, the reason (INFO; 5xx: WARNING; probes and scrapes: DEBUG). A client that went away
is a 499 (as nginx counts it), never a 500.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from aiohttp import web

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID = 128
_PROBES = frozenset({"/health", "/ready", "/health/ready", "/ping", "/metrics", "/version"})
log = logging.getLogger("moebus.access")


@dataclass(slots=True)
class RequestRecord:
    """What the access line says about one request; handlers and generations fill it in."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    trace_id: str | None = None
    model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    error: str | None = None  # the reason of a 4xx/5xx
    generations: list[str] = field(default_factory=list)  # the ids workers know it by (their log lines')

    def generation(self, request_id: str, prompt_tokens: int, completion_tokens: int,
                   first_token_at: float | None) -> None:
        """One generation of this request ended (a completions request may run several)."""
        self.generations.append(request_id)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if first_token_at is not None and (self.first_token_at is None or first_token_at < self.first_token_at):
            self.first_token_at = first_token_at


def request_id_of(headers: dict[str, str] | web.BaseRequest) -> str:
    """The client's X-Request-Id when usable, else a new one."""
    given = headers.get(REQUEST_ID_HEADER, "") if isinstance(headers, dict) else headers.headers.get(
        REQUEST_ID_HEADER, "")
    if 0 < len(given) <= MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


class AccessLog:
    """The record of the request this task is handling (a ContextVar of this app, not a global)."""

    def __init__(self) -> None:
        self.current: ContextVar[RequestRecord | None] = ContextVar(f"access-{id(self)}", default=None)

    def begin(self, request: web.Request) -> RequestRecord:
        rec = RequestRecord(request_id_of(request), request.method, request.path)
        self.current.set(rec)
        return rec

    def record(self) -> RequestRecord | None:
        return self.current.get()

    @staticmethod
    def write(rec: RequestRecord, status: int) -> None:
        now = time.monotonic()
        fields = {"status": status, "method": rec.method, "path": rec.path, "model": rec.model,
                  "prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.completion_tokens,
                  "ttft_s": None if rec.first_token_at is None else round(rec.first_token_at - rec.started, 4),
                  "total_s": round(now - rec.started, 4), "request_id": rec.request_id, "trace_id": rec.trace_id,
                  "error": rec.error, "generations": ",".join(rec.generations) or None}
        if rec.path in _PROBES:  # scraped every few seconds: not worth a line each at INFO
            level = logging.DEBUG
        else:
            level = logging.WARNING if status >= 500 and status != 499 else logging.INFO
        log.log(level, "%s %s %d", rec.method, rec.path, status, extra=fields)  # key=value pairs follow in text
