"""Untrusted image bytes -> a decoded RGB image, or an ImageError that says what is wrong."""
from __future__ import annotations

import hashlib
import io
import warnings

from PIL import Image

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
_MASK = (1 << 63) - 1


class ImageError(ValueError):
    """The client's image cannot be used (reported as a 400)."""


def decode_image(raw: bytes, max_pixels: int) -> Image.Image:
    """Decode fully (a truncated file fails here, not later in a batch); the size is checked from the
    header first, so a decompression bomb is refused before its pixels are allocated."""
    if not raw:
        raise ImageError("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"the image is too large to decode: {e}") from None
    except Exception:
        raise ImageError(f"not an image in a supported format ({', '.join(FORMATS)})") from None
    w, h = image.size
    if w * h > max_pixels:
        raise ImageError(f"the image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}")
    if w < 1 or h < 1:
        raise ImageError("the image has no pixels")
    try:
        image.load()
    except Exception as e:
        raise ImageError(f"the image data is truncated or corrupt: {e}") from None
    return image.convert("RGB")


def content_hash(encoder_name: str, raw: bytes) -> int:
    """Names an image's embeddings everywhere (encoder cache, prefix cache, KV keys): the same
    bytes through the same encoder give the same rows."""
    digest = hashlib.blake2b(raw, digest_size=8, key=encoder_name.encode()[:64]).digest()
    return int.from_bytes(digest, "little") & _MASK
