"""EncoderService: queue-grouped `encode` endpoint; images batched through the encoder, results
cached by content hash, duplicates in flight encoded once."""
from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

import torch
from nats.aio.msg import Msg

from moebus.engine.vision.base import ImageEncoder
from moebus.engine.vision.images import ImageError, content_hash, decode_image
from moebus.engine.vision.registry import load_encoder
from moebus.engine.vision.wire import rows_to_bytes
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import EncodeReply, EncodeRequest, ImageEmbedding, ImagePromptForm
from moebus.shared.service import Service
from moebus.shared.subjects import Queues
from moebus.shared.tracing import Attr, annotate

from .cache import ByteLRU
from .config import EncoderConfig
from .fetch import ImageFetcher


@dataclass(slots=True)
class _Job:
    key: int
    pixels: torch.Tensor
    done: asyncio.Future


class EncoderService(Service):
    name = "encoder"

    def __init__(self, cfg: EncoderConfig, encoder: ImageEncoder | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: EncoderConfig = cfg
        self.served_model = cfg.served_model_name or cfg.model
        self.encoder = encoder
        self.cache: ByteLRU[ImageEmbedding] = ByteLRU(cfg.cache_bytes)
        self.fetcher = ImageFetcher(cfg)
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._inflight: dict[int, asyncio.Future] = {}
        self.n_encoded = self.n_cache_hits = 0  # images run through the encoder / served from its cache
        m = self.metrics
        self._images = m.counter("images_total", "Images asked for, by outcome", ["outcome"])
        self._cache_hits = m.counter("cache_hits_total", "Images served from the encoder cache")
        self._cache_bytes = m.gauge("cache_bytes", "Bytes of rows in the encoder cache")
        self._batch = m.histogram("batch_images", "Images per encoder forward",
                                  buckets=(1, 2, 4, 8, 16, 32, 64))
        self._encode_s = m.histogram("encode_seconds", "Encoder forward time per batch")

    @property
    def ready(self) -> bool:
        return self.encoder is not None

    def model(self) -> str | None:
        return self.served_model

    def stats(self) -> dict[str, Any]:
        return {"cache_entries": len(self.cache), "cache_bytes": self.cache.size, "queued": self._queue.qsize(),
                "encoded": self.n_encoded, "cache_hits": self.n_cache_hits}

    async def setup(self) -> None:
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        if self.encoder is None:
            self.encoder = await asyncio.to_thread(load_encoder, self.cfg.encoder, self.cfg.model, self.cfg.top_k)
        self.spawn(self._batch_loop())
        await self.bus.subscribe(self.subjects.encoder_encode, EncodeRequest, self.encode,
                                 queue=Queues.ENCODER, endpoint="encode")
        # Frontends send an image to the encoder it hashes to (cache affinity); any encoder can take it.
        await self.bus.subscribe(self.subjects.encoder_encode_on(self.instance_id), EncodeRequest, self.encode,
                                 endpoint="encode")

    async def teardown(self) -> None:
        await self.fetcher.close()

    async def encode(self, req: EncodeRequest, _: Msg) -> EncodeReply:
        if req.model != self.served_model:
            raise ServiceError(ErrorCode.NOT_FOUND, f"the encoder serves {self.served_model!r}, not {req.model!r}",
                               param="model")
        if not req.images:
            raise ServiceError(ErrorCode.BAD_REQUEST, "no images to encode", param="messages")
        if len(req.images) > self.cfg.max_images:
            raise ServiceError(ErrorCode.BAD_REQUEST, f"{len(req.images)} images in one request; the limit is "
                               f"{self.cfg.max_images}", param="messages")
        raws = await asyncio.gather(*(self.fetcher.bytes_of(im) for im in req.images))
        out = await asyncio.gather(*(self._one(raw, i) for i, raw in enumerate(raws)))
        hits = sum(hit for _, hit in out)
        annotate({Attr.MODEL: req.model, "moebus.images": len(req.images), "moebus.encoder.cache_hits": hits,
                  "moebus.encoder.tokens": sum(e.num_tokens for e, _ in out)})
        form = self.encoder.prompt_form()
        return EncodeReply(images=[e for e, _ in out], cache_hits=hits,
                           form=ImagePromptForm(placeholder_token_id=form.placeholder_token_id,
                                                prefix=form.prefix, suffix=form.suffix))

    async def _one(self, raw: bytes, index: int) -> tuple[ImageEmbedding, bool]:
        key = content_hash(self.encoder.name, raw)
        cached = self.cache.get(key)
        if cached is not None:
            self._cache_hits.inc()
            self.n_cache_hits += 1
            self._images.labels("cache_hit").inc()
            return cached, True
        pending = self._inflight.get(key)
        first = pending is None
        if first:  # one encode per image in flight, owned by no asker: one that leaves cancels no one else's
            pending = self._inflight[key] = asyncio.get_running_loop().create_future()
            self.spawn(self._encode(key, raw, index, pending))
        emb = await asyncio.shield(pending)
        self._images.labels("encoded" if first else "joined").inc()
        return emb, not first

    async def _encode(self, key: int, raw: bytes, index: int, done: asyncio.Future) -> None:
        """Preprocess off the loop, then queue for the batch loop, which settles `done`."""
        try:
            try:
                pixels = await asyncio.to_thread(self._pixels, raw)
            except ImageError as e:
                raise ServiceError(ErrorCode.BAD_REQUEST, f"image {index}: {e}", param="messages") from None
            self._queue.put_nowait(_Job(key, pixels, done))
            await asyncio.shield(done)
        except Exception as e:
            if not done.done():
                done.set_exception(e)
        finally:
            self._inflight.pop(key, None)

    def _pixels(self, raw: bytes) -> torch.Tensor:
        return self.encoder.preprocess(decode_image(raw, self.cfg.max_pixels))

    async def _batch_loop(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            deadline = time.monotonic() + self.cfg.batch_wait_ms / 1000
            while len(jobs) < self.cfg.max_batch:
                left = deadline - time.monotonic()
                try:
                    jobs.append(self._queue.get_nowait() if left <= 0 else
                                await asyncio.wait_for(self._queue.get(), left))
                except (asyncio.QueueEmpty, TimeoutError):
                    break
            await self._run_batch(jobs)

    async def _run_batch(self, jobs: list[_Job]) -> None:
        started = time.perf_counter()
        try:
            rows = await asyncio.to_thread(self.encoder.encode, [j.pixels for j in jobs])
        except Exception as e:
            for j in jobs:
                if not j.done.done():
                    j.done.set_exception(ServiceError(ErrorCode.INTERNAL, f"encoder failed: {e}"))
            return
        self._batch.observe(len(jobs))
        self.n_encoded += len(jobs)
        self._encode_s.observe(time.perf_counter() - started)
        for j, r in zip(jobs, rows, strict=True):
            data = rows_to_bytes(r, self.cfg.wire_dtype)
            emb = ImageEmbedding(content_hash=j.key, num_tokens=int(r.shape[0]), hidden_size=int(r.shape[1]),
                                 dtype=self.cfg.wire_dtype, data=base64.b64encode(data).decode())
            self.cache.put(j.key, emb, len(emb.data))
            if not j.done.done():
                j.done.set_result(emb)
        self._cache_bytes.set(self.cache.size)
