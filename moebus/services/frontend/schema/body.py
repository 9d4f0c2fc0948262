"""Request body parsing: malformed JSON and schema violations become 400s naming the field.

The body must arrive within `body_timeout_s` (408, connection closed: a slow-loris body),
be at most `max_body_bytes` (413) and nest at most `max_json_depth` levels (400).
JSON that orjson refuses only for its numbers (1e400, NaN, integers past 64 bits) is read again
with the standard library, so the value reaches validation and the 400 names its field. So is text
orjson refuses for not being UTF-8 (a lone surrogate "\ud800", bytes that are not UTF-8): the 400
names the string that holds it, which would otherwise fail deep in rendering or on the bus.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from ..config import RequestLimits
from ..errors import APIError, bad_request
from .protocol import ParamError

B = TypeVar("B", bound=BaseModel)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})
# A surrogate, or the escape of one (pairs too): only then is the whole body walked for a lone one.
_MAYBE_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")


async def parse_body(request: web.Request, model: type[B], limits: RequestLimits) -> B:
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"The request body is larger than {limits.max_body_bytes} bytes, the most this "
                            "server accepts", code="request_too_large", close=True) from None
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout", close=True) from None
    data = _loads(raw)
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > limits.max_json_depth:  # a cheap bound first
        if field := next((k for k, v in data.items() if _deeper(v, limits.max_json_depth - 1)), None):
            raise bad_request(f"{field}: the JSON body nests deeper than {limits.max_json_depth} levels",
                              param=field, code="invalid_json")
    try:
        return model.model_validate(data, context=limits)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(_param(x["loc"])))  # a union's deepest complaint
        cause = (err.get("ctx") or {}).get("error")
        param = cause.param if isinstance(cause, ParamError) else ".".join(_param(err["loc"])) or None
        msg = err["msg"].removeprefix("Value error, ")
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
        raise bad_request(f"{param}: {msg}" if param else msg, param=param, code=code) from None


def _loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)  # refuses lone surrogates, escaped or not, and bytes that are not UTF-8
    except orjson.JSONDecodeError as e:
        first = e
    # NaN, Infinity, 1e400, huge integers: let validation name the field. Bytes that are not UTF-8
    # become lone surrogates here (surrogateescape), as "\ud800" escapes do: _unencodable names them.
    text = raw.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    try:
        data = json.loads(text, parse_int=_int)
    except (ValueError, RecursionError):
        raise bad_request(f"We could not parse the JSON body of your request: {first}",
                          code="invalid_json") from None
    if _MAYBE_SURROGATE.search(text) and (where := _unencodable(data)) is not None:
        msg = "text that is not valid Unicode (a lone UTF-16 surrogate, \\ud800-\\udfff, or bytes not UTF-8)"
        raise bad_request(f"{where or 'the body'}: {msg}", param=where or None, code="invalid_value")
    return data


def _unencodable(data: Any) -> str | None:
    """The path (`messages.0.content`; "" for the body itself) of a string or key that UTF-8 cannot
    encode, or None. A loop, not recursion: the body may nest as deep as json.loads allowed."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, str):
            if not _utf8(node):
                return path
        elif isinstance(node, dict):
            for key in node:
                if not _utf8(key):  # the key itself, shown escaped: the error must be valid UTF-8 too
                    shown = key.encode("utf-8", "backslashreplace").decode()
                    return f"{path}.{shown}" if path else shown
            todo.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(node.items()) if _holds_text(v))
        elif isinstance(node, list):
            todo.extend((f"{path}.{i}" if path else str(i), node[i])
                        for i in reversed(range(len(node))) if _holds_text(node[i]))
    return None


def _holds_text(value: Any) -> bool:
    return isinstance(value, str | dict | list)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _deeper(data: Any, most: int) -> bool:
    """Whether the value nests more than `most` containers deep: level by level, containers only."""
    level = [data] if isinstance(data, dict | list) else []
    for _ in range(most):
        if not level:
            return False
        level = [x for node in level for x in (node.values() if isinstance(node, dict) else node)
                 if isinstance(x, dict | list)]
    return bool(level)


def _int(text: str) -> int | float:
    return int(text) if len(text) <= 64 else float(text)  # past int64 anyway; float() has no digit limit


def _param(loc: tuple[int | str, ...]) -> list[str]:
    """`messages.0.content`, without pydantic's union member tags (`str`, `list[ContentPart]`, ...)."""
    return [str(x) for x in loc if isinstance(x, int) or (
        x.isidentifier() and x not in _TYPE_TAGS and not x[:1].isupper())]
