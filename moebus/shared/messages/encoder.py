"""Vision encoder messages: images in, embedding rows out; and the rows as a generate request
carries them (prompt offset + content hash + the rows themselves)."""
from __future__ import annotations

import base64
from typing import Literal

from pydantic import model_validator

from ..codec import Message


class ImageInput(Message):
    """One image: its file bytes (a data URL, decoded by the frontend), or a URL the encoder
    fetches (http(s) only when enabled; file:// only under an allowed directory)."""

    data: str | None = None  # base64 of the file bytes
    url: str | None = None

    @classmethod
    def of_bytes(cls, raw: bytes) -> ImageInput:
        return cls(data=base64.b64encode(raw).decode())

    def raw(self) -> bytes:
        return base64.b64decode(self.data or "")

    @model_validator(mode="after")
    def _one_source(self) -> ImageInput:
        if (self.data is None) == (self.url is None):
            raise ValueError("give exactly one of data or url")
        return self


class EncodeRequest(Message):
    model: str  # the language model the rows are for (their width and meaning depend on it)
    images: list[ImageInput]


class ImagePromptForm(Message):
    """How an image is written into the prompt: prefix text, placeholder token x n, suffix text."""

    placeholder_token_id: int
    prefix: str = ""
    suffix: str = ""


class ImageEmbedding(Message):
    """An encoded image. In a GenerateRequest, `offset` is the prompt position of its first
    placeholder token; the encoder leaves it 0."""

    content_hash: int  # 63 bits over the encoder's name and the image bytes
    num_tokens: int
    hidden_size: int
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    data: str  # base64, row-major [num_tokens, hidden_size]
    offset: int = 0

    def raw(self) -> bytes:
        """The rows' bytes; raises ValueError when they do not match the stated shape."""
        raw = base64.b64decode(self.data)
        width = 4 if self.dtype == "float32" else 2
        if len(raw) != self.num_tokens * self.hidden_size * width:
            raise ValueError("embedding bytes do not match num_tokens x hidden_size")
        return raw


class EncodeReply(Message):
    images: list[ImageEmbedding]
    form: ImagePromptForm
    cache_hits: int = 0
