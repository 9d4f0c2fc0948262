"""Image bytes from an ImageInput: inline data, a file under the allowed directory, or (when
enabled) an http(s) URL fetched with a size cap and a deadline."""
from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import unquote, urlparse

import aiohttp

from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import ImageInput

from .config import EncoderConfig


def _bad(message: str) -> ServiceError:
    return ServiceError(ErrorCode.BAD_REQUEST, message, param="messages")


class ImageFetcher:
    def __init__(self, cfg: EncoderConfig) -> None:
        self.cfg = cfg
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def bytes_of(self, image: ImageInput) -> bytes:
        if image.data is not None:
            raw = image.raw()
        else:
            url = image.url or ""
            scheme = urlparse(url).scheme
            if scheme in ("http", "https"):
                raw = await self._http(url)
            elif scheme in ("file", ""):
                raw = await asyncio.to_thread(self._file, url)
            else:
                raise _bad(f"image URL scheme {scheme!r} is not supported (use a data URL)")
        if len(raw) > self.cfg.max_image_bytes:
            raise _bad(f"the image is {len(raw)} bytes; the limit is {self.cfg.max_image_bytes}")
        return raw

    def _file(self, url: str) -> bytes:
        root = self.cfg.allowed_local_dir
        if root is None:
            raise _bad("local image files are not enabled on this server (use a data URL)")
        path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url).resolve()
        if not path.is_relative_to(Path(root).resolve()):
            raise _bad("the image file is outside the allowed directory")
        try:
            if path.stat().st_size > self.cfg.max_image_bytes:
                raise _bad(f"the image file is larger than {self.cfg.max_image_bytes} bytes")
            return path.read_bytes()
        except OSError:
            raise _bad("the image file cannot be read") from None

    async def _http(self, url: str) -> bytes:
        if not self.cfg.allow_http:
            raise _bad("image URLs are not enabled on this server (use a data URL)")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.fetch_timeout_s))
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    raise _bad(f"fetching the image URL gave HTTP {resp.status}")
                raw = await resp.content.read(self.cfg.max_image_bytes + 1)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _bad(f"the image URL could not be fetched: {type(e).__name__}") from None
        if len(raw) > self.cfg.max_image_bytes:
            raise _bad(f"the image at the URL is larger than {self.cfg.max_image_bytes} bytes")
        return raw
