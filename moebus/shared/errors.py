"""Typed errors that cross the bus as reply headers (body stays empty), and back into exceptions.

A handler raises `ServiceError`; the bus turns it into ``Moebus-Error*`` headers on the reply; the
caller's `Bus.request` raises it again. Transport failures are distinct classes: `NoResponders`
(nobody subscribed: fail fast, try another instance) is not `RequestTimeout` (someone may be
working on it: do not blindly retry a non-idempotent request).
"""
from __future__ import annotations

from enum import StrEnum

ERROR_HEADER = "Moebus-Error"
MESSAGE_HEADER = "Moebus-Error-Message"
PARAM_HEADER = "Moebus-Error-Param"
RETRY_AFTER_HEADER = "Moebus-Retry-After"


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    PROMPT_TOO_LONG = "prompt_too_long"
    OVERLOADED = "overloaded"  # queues full: come back later (HTTP 429)
    UNAVAILABLE = "unavailable"  # nobody can serve right now (HTTP 503)
    NO_RESPONDERS = "no_responders"
    TIMEOUT = "timeout"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"
    PAYLOAD_TOO_LARGE = "payload_too_large"  # a message over the bus's max payload (HTTP 413)
    ENGINE_FAILED = "engine_failed"  # a step failed with no single request to blame: another worker may succeed
    REQUEST_FAILED = "request_failed"  # the engine failed this request alone (its own state raised): never retried
    DRAINING = "draining"  # handed back unstarted by a stopping worker: rerun elsewhere, not a failure of the request
    ABORTED = "aborted"  # someone (an operator, another frontend) told the worker to stop it: the stream ends


class ServiceError(Exception):
    """An error a service reports on purpose; `retryable` means another instance may succeed."""

    def __init__(
        self,
        code: ErrorCode | str,
        message: str = "",
        *,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
        self.message = message or self.code.value
        self.param = param
        self.retry_after = retry_after
        super().__init__(f"{self.code}: {self.message}")

    @property
    def retryable(self) -> bool:
        return self.code in (ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.NO_RESPONDERS,
                             ErrorCode.WORKER_LOST, ErrorCode.ENGINE_FAILED, ErrorCode.DRAINING)

    def to_headers(self) -> dict[str, str]:
        # Header values are single lines on the wire.
        headers = {ERROR_HEADER: self.code.value, MESSAGE_HEADER: _one_line(self.message)}
        if self.param:
            headers[PARAM_HEADER] = self.param
        if self.retry_after is not None:
            headers[RETRY_AFTER_HEADER] = f"{self.retry_after:g}"
        return headers

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> ServiceError | None:
        if not headers or ERROR_HEADER not in headers:
            return None
        retry = headers.get(RETRY_AFTER_HEADER)
        return cls(
            headers[ERROR_HEADER],
            headers.get(MESSAGE_HEADER, ""),
            param=headers.get(PARAM_HEADER),
            retry_after=float(retry) if retry else None,
        )


class NoResponders(ServiceError):
    def __init__(self, subject: str) -> None:
        super().__init__(ErrorCode.NO_RESPONDERS, f"no responders on {subject}")
        self.subject = subject


class RequestTimeout(ServiceError):
    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(ErrorCode.TIMEOUT, f"no reply on {subject} within {timeout:g}s")
        self.subject = subject


def context_length_exceeded(max_model_len: int, prompt_tokens: int, param: str,
                            max_tokens: int | None = None) -> ServiceError:
    """PROMPT_TOO_LONG in vLLM's words; `param` is "messages" or "prompt"."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        text = (f"your {param} resulted in {prompt_tokens} tokens (at most {max_model_len - 1} leave room for "
                f"the completion). Please reduce the length of the {param}.")
    else:
        text = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} "
                f"in the completion). Please reduce the length of the {param} or completion.")
    return ServiceError(ErrorCode.PROMPT_TOO_LONG, head + text, param=param)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:1000]
