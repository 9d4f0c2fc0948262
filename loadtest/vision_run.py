"""Vision encoder figures (issue 16, item 6): encoder latency per image and throughput with 1 and 2
encoder processes, and photo-question requests/s through the whole stack.

    python loadtest/vision_run.py            # ~3 min on 2 cores; writes ~/.cache/moebus/loadtest/vision/vision.json

For each encoder count N in --encoders (alternating runs, --rounds each):
  1. starts the stack on the real model (1 worker, 1 torch thread per process, N encoders);
  2. encoder alone: 8 distinct photos one at a time (latency of one image); then --images distinct photos (cat.jpg with one pixel changed: no cache hit) sent
     straight to `encoder.encode` on the bus, --concurrency at a time; per-image latency (p50, p90)
     and images/s;
  3. the same photos again: every one a cache hit (latency of a hit);
  4. whole stack: --requests chat completions with a distinct photo each (openai SDK, max_tokens 8,
     greedy), --concurrency at a time: requests/s and latency p50.
Prints medians over rounds and the spread (min..max).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import openai  # noqa: E402
from PIL import Image  # noqa: E402

from moebus.loadtest.cli import default_results_dir  # noqa: E402
from moebus.services.launcher import Stack, StackConfig  # noqa: E402
from moebus.shared.bus import Bus, BusConfig  # noqa: E402
from moebus.shared.messages import EncodeReply, EncodeRequest, ImageInput  # noqa: E402
from moebus.shared.nats_server import free_port  # noqa: E402
from moebus.shared.subjects import Subjects  # noqa: E402
from moebus.shared.tracing import Tracing  # noqa: E402

OUT = default_results_dir() / "vision"  # out of the source tree, as `moebus loadtest run`'s folders
PHOTO = REPO / "tests/data/images/cat.jpg"


def distinct_photos(n: int, salt: int) -> list[bytes]:
    base = Image.open(PHOTO).convert("RGB")
    out = []
    for i in range(n):
        im = base.copy()
        im.putpixel((i % im.width, salt % im.height), ((i * 7) % 256, salt % 256, 3))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def bounded(coros, concurrency: int) -> list:
    sem = asyncio.Semaphore(concurrency)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


async def encoder_pass(bus: Bus, photos: list[bytes], concurrency: int) -> dict:
    async def one(raw: bytes) -> float:
        t = time.perf_counter()
        await bus.request(Subjects().encoder_encode, EncodeRequest(model="smollm2", images=[ImageInput.of_bytes(raw)]),
                          EncodeReply, 60)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    lat = await bounded([one(p) for p in photos], concurrency)
    wall = time.perf_counter() - t0
    return {"p50_ms": 1000 * pct(lat, 0.5), "p90_ms": 1000 * pct(lat, 0.9), "images_per_s": len(photos) / wall}


async def stack_pass(url: str, photos: list[bytes], concurrency: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(raw: bytes) -> float:
        t = time.perf_counter()
        u = "data:image/png;base64," + base64.b64encode(raw).decode()
        r = await client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}},
                                         {"type": "text", "text": "What is in this image?"}]}])
        assert r.choices[0].finish_reason in ("stop", "length")
        return time.perf_counter() - t

    t0 = time.perf_counter()
    lat = await bounded([one(p) for p in photos], concurrency)
    return {"req_per_s": len(photos) / (time.perf_counter() - t0), "p50_s": pct(lat, 0.5)}


async def run_one(n_enc: int, args: argparse.Namespace, salt: int) -> dict:
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="smollm2", workers=1, encoders=n_enc,
                      worker={"torch_threads": 1}, encoder={"torch_threads": 1}, heartbeat_interval_s=0.5)
    with Stack(cfg) as stack:
        bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="bench"), Tracing("bench"))
        try:
            await encoder_pass(bus, distinct_photos(4, salt + 999), args.concurrency)  # warm up
            alone = await encoder_pass(bus, distinct_photos(8, salt + 555), 1)
            photos = distinct_photos(args.images, salt)
            miss = await encoder_pass(bus, photos, args.concurrency)
            hit = await encoder_pass(bus, photos, args.concurrency)
        finally:
            await bus.drain()
        whole = await stack_pass(stack.url, distinct_photos(args.requests, salt + 1), args.concurrency)
    return {"encoders": n_enc, "alone": alone, "miss": miss, "hit": hit, "stack": whole}


def summary(runs: list[dict]) -> dict:
    def med(path: tuple[str, str]) -> str:
        xs = [r[path[0]][path[1]] for r in runs]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"

    return {"encode p50 ms (one at a time)": med(("alone", "p50_ms")), "encode p50 ms (miss)": med(("miss", "p50_ms")), "encode p90 ms (miss)": med(("miss", "p90_ms")),
            "images/s (miss)": med(("miss", "images_per_s")), "encode p50 ms (cache hit)": med(("hit", "p50_ms")),
            "stack req/s": med(("stack", "req_per_s")), "stack p50 s": med(("stack", "p50_s"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoders", default="1,2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    counts = [int(x) for x in args.encoders.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(args.rounds):  # alternate the configurations round by round
        for n in counts:
            runs[n].append(asyncio.run(run_one(n, args, salt=r * 100 + n)))
            print(json.dumps(runs[n][-1]), flush=True)
    table = {n: summary(rs) for n, rs in runs.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vision.json").write_text(json.dumps({"args": vars(args), "runs": runs, "summary": table}, indent=1))
    for n, s in table.items():
        print(f"{n} encoder(s): " + ", ".join(f"{k} {v}" for k, v in s.items()))


if __name__ == "__main__":
    main()
