"""Message base class: pydantic models on the wire as orjson bytes."""
from __future__ import annotations

from typing import Self, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict


class Message(BaseModel):
    """Base of every bus message. Unknown fields are ignored so old readers accept newer writers."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json", exclude_defaults=True))

    @classmethod
    def decode(cls, data: bytes | str) -> Self:
        return cls.model_validate(orjson.loads(data))


def encode(msg: Message) -> bytes:
    return msg.encode()


M = TypeVar("M", bound=Message)


def decode(cls: type[M], data: bytes | str) -> M:
    return cls.decode(data)
