"""The encoder service in-process on a real nats-server, with a stand-in encoder that records its
batches: cache by content hash, one encode for concurrent duplicates, batching, limits and errors.
The real encoder runs in test_vision_stack.py."""
from __future__ import annotations

import asyncio
import base64
import io
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from moebus.engine.vision.base import PromptForm
from moebus.services.encoder import ByteLRU, EncoderConfig, EncoderService
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import ServiceError
from moebus.shared.messages import EncodeReply, EncodeRequest, ImageInput
from moebus.shared.tracing import Tracing

from .conftest import toy_stack

IMAGES = Path(__file__).parent.parent / "data" / "images"


class RecordingEncoder:
    """Rows = the image's mean colour, repeated; remembers every batch it ran."""

    name = "recording"
    hidden_size = 3

    def __init__(self, delay_s: float = 0.0) -> None:
        self.batches: list[int] = []
        self.delay_s = delay_s

    def num_tokens(self, image: Image.Image) -> int:
        return 2

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(np.asarray(image.resize((4, 4)), dtype=np.float32)).reshape(-1, 3).mean(0)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        import time

        time.sleep(self.delay_s)  # runs in a worker thread, as the real forward does
        self.batches.append(len(pixels))
        return [p.repeat(2, 1) for p in pixels]

    def prompt_form(self) -> PromptForm:
        return PromptForm(placeholder_token_id=5, prefix="<img>", suffix="</img>")


def png(colour: tuple[int, int, int], size: tuple[int, int] = (8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


async def started(nats_url: str, encoder: RecordingEncoder, **cfg) -> tuple[EncoderService, Bus, str]:
    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    svc = EncoderService(EncoderConfig(nats_url=nats_url, subject_prefix=prefix, model="m", **cfg), encoder=encoder)
    await svc.__aenter__()
    bus = await Bus.connect(BusConfig(servers=[nats_url], name="client"), Tracing("client"))
    return svc, bus, prefix


async def encode(svc: EncoderService, bus: Bus, images: list[ImageInput], model: str = "m") -> EncodeReply:
    return await bus.request(svc.subjects.encoder_encode, EncodeRequest(model=model, images=images), EncodeReply, 10)


async def test_duplicates_encode_once_and_repeats_hit_the_cache(nats_server) -> None:
    enc = RecordingEncoder(delay_s=0.2)
    svc, bus, _ = await started(nats_server.url, enc, batch_wait_ms=20)
    try:
        red, blue = ImageInput.of_bytes(png((255, 0, 0))), ImageInput.of_bytes(png((0, 0, 255)))
        replies = await asyncio.gather(*(encode(svc, bus, [red]) for _ in range(3)), encode(svc, bus, [blue]))
        assert svc.n_encoded == 2 and sum(enc.batches) == 2  # three askers of red: one encode
        hashes = {r.images[0].content_hash for r in replies}
        assert len(hashes) == 2
        again = await encode(svc, bus, [red, blue])
        assert again.cache_hits == 2 and svc.n_encoded == 2
        first = replies[0].images[0]
        assert (first.num_tokens, first.hidden_size, first.dtype) == (2, 3, "float16")
        assert again.form.prefix == "<img>" and again.form.placeholder_token_id == 5
    finally:
        await bus.drain()
        await svc.__aexit__(None, None, None)


async def test_concurrent_images_share_one_batch(nats_server) -> None:
    enc = RecordingEncoder()
    svc, bus, _ = await started(nats_server.url, enc, batch_wait_ms=100, max_batch=8)
    try:
        imgs = [ImageInput.of_bytes(png((i * 40, 10, 10))) for i in range(4)]
        await asyncio.gather(*(encode(svc, bus, [im]) for im in imgs))
        assert enc.batches == [4]
    finally:
        await bus.drain()
        await svc.__aexit__(None, None, None)


@pytest.mark.parametrize("image, cfg, message", [
    (ImageInput.of_bytes(b"GIF89a-not-really"), {}, "not an image"),
    (ImageInput.of_bytes(png((1, 2, 3), (300, 300))), {"max_pixels": 50_000}, "pixels"),
    (ImageInput.of_bytes(png((1, 2, 3), (300, 300))), {"max_image_bytes": 200}, "bytes"),
    (ImageInput(url="https://example.invalid/a.png"), {}, "not enabled"),
    (ImageInput(url="ftp://example.invalid/a.png"), {}, "scheme"),
    (ImageInput(url="http://127.0.0.1:9/a.png"), {"allow_http": True, "fetch_timeout_s": 2}, "could not be fetched"),
    (ImageInput(url=str(IMAGES / "cat.jpg")), {}, "not enabled"),
    (ImageInput(url="/etc/hostname"), {"allowed_local_dir": str(IMAGES)}, "outside"),
])
async def test_bad_images_are_bad_requests(nats_server, image, cfg, message) -> None:
    svc, bus, _ = await started(nats_server.url, RecordingEncoder(), **cfg)
    try:
        with pytest.raises(ServiceError) as e:
            await encode(svc, bus, [image])
        assert e.value.code == "bad_request" and message in e.value.message, e.value.message
        ok = await encode(svc, bus, [ImageInput.of_bytes(png((9, 9, 9)))])  # and it still serves
        assert ok.images[0].num_tokens == 2
    finally:
        await bus.drain()
        await svc.__aexit__(None, None, None)


async def test_files_under_the_allowed_dir_and_request_limits(nats_server) -> None:
    svc, bus, _ = await started(nats_server.url, RecordingEncoder(), allowed_local_dir=str(IMAGES), max_images=2)
    try:
        r = await encode(svc, bus, [ImageInput(url=f"file://{IMAGES / 'cat.jpg'}")])
        assert r.images[0].num_tokens == 2
        with pytest.raises(ServiceError, match="limit is 2"):
            await encode(svc, bus, [ImageInput(url=str(IMAGES / "cat.jpg"))] * 3)
        with pytest.raises(ServiceError) as e:
            await encode(svc, bus, [ImageInput(url=str(IMAGES / "cat.jpg"))], model="other")
        assert e.value.code == "not_found"
    finally:
        await bus.drain()
        await svc.__aexit__(None, None, None)


def test_byte_lru_evicts_least_recent_by_bytes() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    lru.put(1, "a", 40)
    lru.put(2, "b", 40)
    assert lru.get(1) == "a"  # 1 is now the most recent
    lru.put(3, "c", 40)  # over 100: the least recent (2) goes
    assert lru.get(2) is None and lru.get(1) == "a" and lru.get(3) == "c" and lru.size == 80
    lru.put(4, "huge", 500)  # larger than the whole cache: not kept, nothing evicted
    assert lru.get(4) is None and len(lru) == 2


async def test_a_stack_without_an_encoder_refuses_images_with_a_400(nats_server) -> None:
    import openai

    async with toy_stack(nats_server.url) as s:
        with pytest.raises(openai.BadRequestError, match="does not accept image inputs"):
            await s.client().chat.completions.create(model="toy", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "what is this?"}]}])
        with pytest.raises(openai.BadRequestError, match="not supported"):
            await s.client().chat.completions.create(model="toy", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])
        r = await s.client().chat.completions.create(model="toy", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert r.choices[0].message.content


async def test_the_same_image_goes_to_the_same_encoder(nats_server) -> None:
    """Two encoders: the frontend's picker sends each image to the encoder it hashes to, so a
    repeated image is encoded once in the fleet, and different images spread over both."""
    from moebus.services.frontend.fleet.encoders import EncoderPicker

    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    encs = [RecordingEncoder(), RecordingEncoder()]
    svcs = [EncoderService(EncoderConfig(nats_url=nats_server.url, subject_prefix=prefix, model="m",
                                         instance_id=f"encoder-{k}", heartbeat_interval_s=0.1), encoder=e)
            for k, e in enumerate(encs)]
    for s in svcs:
        await s.__aenter__()
    bus = await Bus.connect(BusConfig(servers=[nats_server.url], name="client"), Tracing("client"))
    try:
        picker = EncoderPicker(bus, svcs[0].subjects)
        await picker.start()
        deadline = asyncio.get_running_loop().time() + 5
        while len(picker.live()) < 2:
            assert asyncio.get_running_loop().time() < deadline, "no heartbeats from both encoders"
            await asyncio.sleep(0.05)
        images = [ImageInput.of_bytes(png((k * 20, 0, 0))) for k in range(12)]
        for _ in range(3):
            for im in images:
                target = picker.pick(im.data)
                await bus.request(svcs[0].subjects.encoder_encode_on(target),
                                  EncodeRequest(model="m", images=[im]), EncodeReply, 10)
        assert sum(s.n_encoded for s in svcs) == 12  # each image once, in the whole fleet
        assert all(s.n_encoded > 0 for s in svcs)  # and the images spread over both
    finally:
        await bus.drain()
        for s in svcs:
            await s.__aexit__(None, None, None)


async def test_http_images_when_enabled_with_a_size_cap(nats_server) -> None:
    from aiohttp import web

    from moebus.shared.nats_server import free_port

    def serve(**kw):
        async def handler(_: web.Request) -> web.Response:
            return web.Response(**kw)

        return handler

    app = web.Application()
    app.router.add_get("/cat.jpg", serve(body=(IMAGES / "cat.jpg").read_bytes()))
    app.router.add_get("/big.png", serve(body=b"\0" * 50_000))
    app.router.add_get("/missing.png", serve(status=404))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    svc, bus, _ = await started(nats_server.url, RecordingEncoder(), allow_http=True, max_image_bytes=40_000)
    try:
        r = await encode(svc, bus, [ImageInput(url=f"http://127.0.0.1:{port}/cat.jpg")])
        assert r.images[0].num_tokens == 2
        for path, message in (("big.png", "larger than"), ("missing.png", "HTTP 404")):
            with pytest.raises(ServiceError, match=message):
                await encode(svc, bus, [ImageInput(url=f"http://127.0.0.1:{port}/{path}")])
    finally:
        await bus.drain()
        await svc.__aexit__(None, None, None)
        await runner.cleanup()


async def test_an_encoder_killed_holding_the_request_costs_one_timeout_not_the_request(nats_server) -> None:
    """The frontend's picked encoder swallows the request (SIGKILLed with its subscription still on
    the server): after encoder_timeout_s the frontend asks any encoder instead of failing with 504."""
    from types import SimpleNamespace

    from moebus.services.frontend import FrontendConfig
    from moebus.services.frontend.service import FrontendService

    svc, bus, prefix = await started(nats_server.url, RecordingEncoder())
    zombie = await Bus.connect(BusConfig(servers=[nats_server.url], name="zombie"), Tracing("zombie"))
    swallowed = []

    async def swallow(req: EncodeRequest, _) -> None:
        swallowed.append(len(req.images))
    forgot = []
    try:
        await zombie.subscribe(svc.subjects.encoder_encode_on("encoder-z"), EncodeRequest, swallow)
        await zombie.flush()
        picker = SimpleNamespace(pick=lambda key: "encoder-z", forget=forgot.append)
        cfg = FrontendConfig(nats_url=nats_server.url, subject_prefix=prefix, accept_images=True,
                             encoder_timeout_s=0.5, restart_wait_s=5.0)
        fe = SimpleNamespace(cfg=cfg, encoders=picker, bus=bus, subjects=svc.subjects)
        url = "data:image/png;base64," + base64.b64encode(png((200, 10, 10))).decode()
        reply = await FrontendService.encode_images(fe, "m", [url])
        assert swallowed == [1] and forgot == ["encoder-z"]
        assert len(reply.images) == 1
    finally:
        await zombie.drain()
        await bus.drain()
        await svc.__aexit__(None, None, None)
