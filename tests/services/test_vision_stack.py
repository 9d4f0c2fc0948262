"""Photos through the whole stack on the real model (encoder, tokenizer, worker as processes), with
the openai SDK: the answer names the object, a repeated image hits the encoder cache, different
images with the same text never share KV, and bad images are 400s."""
from __future__ import annotations

import base64
import signal
import struct
import threading
import zlib
from pathlib import Path

import openai
import pytest

from moebus.services.supervisor import RestartPolicy, Supervisor

from .conftest import real_model_stack, service_stats

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

IMAGES = Path(__file__).parent.parent / "data" / "images"
QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from real_model_stack(tmp_path_factory, workers=1, worker={"torch_threads": 1},
                                encoders=1, encoder={"torch_threads": 1})  # smollm2 takes none unless asked


def data_url(raw: bytes, media: str = "image/jpeg") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def photo(name: str) -> str:
    return data_url((IMAGES / name).read_bytes())


def ask(url: str | list[str], question: str = QUESTION) -> list[dict]:
    urls = [url] if isinstance(url, str) else url
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": question}]}]


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def encoder_stats(stack) -> dict:
    return await service_stats(stack, "encoder", "encoder-0")


async def test_photo_question_names_the_object(stack) -> None:
    c = client(stack)
    for name, word in (("cat.jpg", "cat"), ("rocket.jpg", "missile")):
        r = await c.chat.completions.create(model="smollm2", messages=ask(photo(name)), max_tokens=16,
                                            temperature=0)
        assert word in r.choices[0].message.content.lower(), (name, r.choices[0].message.content)
    chunks = [ch async for ch in await c.chat.completions.create(  # streamed too
        model="smollm2", messages=ask(photo("cat.jpg")), max_tokens=16, temperature=0, stream=True)]
    assert "cat" in "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).lower()


async def test_same_image_twice_hits_the_encoder_cache(stack) -> None:
    c = client(stack)
    url = photo("coffee.jpg")
    before = await encoder_stats(stack)
    first = await c.chat.completions.create(model="smollm2", messages=ask(url), max_tokens=8, temperature=0)
    again = await c.chat.completions.create(model="smollm2", messages=ask(url), max_tokens=8, temperature=0)
    after = await encoder_stats(stack)
    assert after["encoded"] - before["encoded"] == 1
    assert after["cache_hits"] - before["cache_hits"] == 1
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # and the prompt's KV was reused


async def test_different_images_with_the_same_text_do_not_share_kv(stack) -> None:
    c = client(stack)
    long_q = "Look carefully at every detail and then answer in a few words: " + QUESTION
    a = await c.chat.completions.create(model="smollm2", messages=ask(photo("cat.jpg"), long_q), max_tokens=12,
                                        temperature=0)
    b = await c.chat.completions.create(model="smollm2", messages=ask(photo("rocket.jpg"), long_q), max_tokens=12,
                                        temperature=0)
    a2 = await c.chat.completions.create(model="smollm2", messages=ask(photo("cat.jpg"), long_q), max_tokens=12,
                                         temperature=0)
    # The template's system prompt (~25 tokens) comes first, so the image sits in the second
    # 16-token block: b may share the first block with a, never one holding or following the image.
    assert b.usage.prompt_tokens_details.cached_tokens <= 16
    assert a2.usage.prompt_tokens_details.cached_tokens >= a2.usage.prompt_tokens - 16  # the same image: all
    assert a.choices[0].message.content != b.choices[0].message.content
    assert a2.choices[0].message.content == a.choices[0].message.content


def png_header_only(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height (its pixel data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("url, message", [
    (data_url(b"this is not an image"), "not an image"),
    (data_url((IMAGES / "cat.jpg").read_bytes()[:3000]), "truncated"),
    (data_url(png_header_only(12000, 9000), "image/png"), "pixels"),  # 108 megapixels
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "base64"),
    ("http://127.0.0.1:9/cat.jpg", "not enabled"),
    ("file:///etc/passwd", "not enabled"),
])
async def test_bad_images_are_400s(stack, url: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client(stack).chat.completions.create(model="smollm2", messages=ask(url), max_tokens=4)
    assert message in str(e.value), str(e.value)


async def test_too_many_images_is_a_400_and_the_stack_still_serves(stack) -> None:
    c = client(stack)
    with pytest.raises(openai.BadRequestError, match="limit"):
        await c.chat.completions.create(model="smollm2", messages=ask([photo("cat.jpg")] * 9), max_tokens=4)
    r = await c.chat.completions.create(model="smollm2", messages=ask([photo("cat.jpg"), photo("coffee.jpg")]),
                                        max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def split_stack(tmp_path_factory):
    yield from real_model_stack(tmp_path_factory, mode="disaggregated", prefill_workers=1, decode_workers=1,
                                worker={"torch_threads": 1}, encoders=1, encoder={"torch_threads": 1})


async def test_disaggregated_answers_as_aggregated(stack, split_stack) -> None:
    """encoder -> prefill -> KV transfer -> decode gives the aggregated worker's tokens."""
    received = (await service_stats(split_stack, "worker", "decode-0"))["kv"]["kv_received"]
    for name in ("cat.jpg", "coffee.jpg"):
        want = await client(stack).chat.completions.create(model="smollm2", messages=ask(photo(name)),
                                                           max_tokens=16, temperature=0)
        got = await client(split_stack).chat.completions.create(model="smollm2", messages=ask(photo(name)),
                                                                max_tokens=16, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
    assert (await service_stats(split_stack, "worker", "decode-0"))["kv"]["kv_received"] == received + 2


async def test_a_killed_encoder_is_restarted_and_no_image_request_fails(stack) -> None:
    """SIGKILL the encoder; the supervisor restarts it under its id while a photo request waits for
    an encoder to answer again (restart_wait_s) instead of failing."""
    sup = Supervisor(stack, RestartPolicy(backoff_s=0.2))
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            assert sup.check() is None

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        old = stack.procs["encoder-0"].pid
        stack.kill("encoder-0", signal.SIGKILL)
        r = await client(stack).chat.completions.create(model="smollm2", messages=ask(photo("cat.jpg")),
                                                        max_tokens=16, temperature=0)
        assert "cat" in r.choices[0].message.content.lower()
        assert stack.procs["encoder-0"].pid != old
    finally:
        stop.set()
        watcher.join(5)
