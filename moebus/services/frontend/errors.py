"""OpenAI-style JSON errors: ``{"error": {"message", "type", "param", "code"}}`` with HTTP statuses."""
from __future__ import annotations

import math

from aiohttp import web

from moebus.shared.errors import ErrorCode, ServiceError

# ServiceError code -> (HTTP status, OpenAI error type)
_STATUS = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    ErrorCode.NO_RESPONDERS: (503, "service_unavailable"),
    ErrorCode.WORKER_LOST: (503, "service_unavailable"),
    ErrorCode.TIMEOUT: (504, "timeout"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.ENGINE_FAILED: (503, "service_unavailable"),
    ErrorCode.REQUEST_FAILED: (500, "server_error"),
    ErrorCode.DRAINING: (503, "service_unavailable"),
    ErrorCode.ABORTED: (503, "service_unavailable"),  # stopped on purpose by someone else: not moved
}
_CODE = {ErrorCode.PROMPT_TOO_LONG: "context_length_exceeded"}  # OpenAI's name for it


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: float | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.retry_after = param, code, retry_after
        self.close = close  # close the connection after the reply (a body left unread)

    @classmethod
    def from_service_error(cls, e: ServiceError) -> APIError:
        status, kind = _STATUS.get(e.code, (500, "server_error"))
        retry = e.retry_after if e.retry_after is not None else (1.0 if status in (429, 503) else None)
        return cls(status, e.message, type=kind, param=e.param, code=_CODE.get(e.code, e.code.value),
                   retry_after=retry)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.retry_after else None
        resp = web.json_response(self.body(), status=self.status, headers=headers)
        if self.close:
            resp.force_close()
        return resp


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
