"""Request body parsing: malformed JSON and schema violations become 400s naming the field."""
from __future__ import annotations

from typing import TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from .errors import bad_request

B = TypeVar("B", bound=BaseModel)


async def parse_body(request: web.Request, model: type[B]) -> B:
    raw = await request.read()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        return _raise(f"{param}: {msg}" if param else msg, param, err["type"])


def _raise(message: str, param: str | None, code: str) -> BaseModel:
    raise bad_request(message, param=param, code="missing_required_parameter" if code == "missing" else
                      "invalid_value")
