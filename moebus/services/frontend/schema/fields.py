"""The base of every request model: unknown fields tolerated, no NaN/inf, `ParamError` for
cross-field violations, and the deployment's limits as the validation context."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo

from ..config import RequestLimits

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the engine's token tensors are int32/int64
_DEFAULT_LIMITS = RequestLimits()


class ParamError(ValueError):
    """A violation that involves several fields: `param` names the one to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def limits_of(info: ValidationInfo) -> RequestLimits:
    return info.context if isinstance(info.context, RequestLimits) else _DEFAULT_LIMITS


class _Req(BaseModel):
    # Unknown fields of nested objects are tolerated, not honoured; NaN and +-inf are never a valid
    # number. The top-level bodies (protocol.py) keep unknown fields to warn about them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
