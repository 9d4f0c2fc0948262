"""Image parts of a chat request -> encoder inputs; encoded images -> their prompt positions."""
from __future__ import annotations

import base64
import binascii

from moebus.shared.messages import ImageEmbedding, ImageInput

from ..errors import bad_request


def image_input(url: str) -> ImageInput:
    """A data URL's base64 payload goes on as is (the encoder decodes and checks the image); other
    URLs go to the encoder, which fetches them only where its operator allowed it."""
    if not url.startswith("data:"):
        return ImageInput(url=url)
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise bad_request("an image data URL must be base64: data:image/<type>;base64,<data>", param="messages")
    if not header[5:].startswith("image/"):
        raise bad_request(f"the data URL's media type {header[5:-7]!r} is not an image", param="messages")
    try:
        base64.b64decode(payload[:64] + "=" * (-len(payload[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image data URL is not valid base64", param="messages") from None
    return ImageInput(data=payload)


def place(images: list[ImageEmbedding], offsets: list[int]) -> list[ImageEmbedding]:
    """The encoded images with the prompt offsets the tokenizer gave them."""
    return [im.model_copy(update={"offset": off}) for im, off in zip(images, offsets, strict=True)]
