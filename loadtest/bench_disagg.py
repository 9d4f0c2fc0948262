"""TTFT and throughput: aggregated (no prefix cache) vs aggregated with the prefix cache and
KV-aware routing vs prefill/decode disaggregation, at several shared-prefix (cache-hit) rates.

    python loadtest/bench_disagg.py                        # small scale (2 cores, SmolLM2)
    python loadtest/bench_disagg.py --requests 32 --concurrency 8 --prompt-words 400

Each request: a prompt of --prompt-words words whose first (hit rate) share is a prefix common
to every request of that run, the rest unique; greedy, EOS ignored, --max-tokens tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import openai

from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

SETUPS: dict[str, dict[str, Any]] = {
    "aggregated, no prefix cache": {"workers": 2, "engine": {"enable_prefix_caching": False}, "kvbroker": False},
    "aggregated + prefix cache + KV routing": {"workers": 2},
    "disaggregated 1P+1D + prefix cache": {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 1},
}
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompts(n: int, words: int, hit: float, tag: str) -> list[str]:
    shared = int(words * hit)
    prefix = " ".join(f"{tag}{WORDS[i % len(WORDS)]}{i % 7}" for i in range(shared))
    out = []
    for r in range(n):
        own = " ".join(f"{WORDS[(i * 7 + r) % len(WORDS)]}{r}x{i}" for i in range(words - shared))
        out.append(f"{prefix} {own}".strip())
    return out


async def run(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = cached = prompt_tokens = 0

    async def one(text: str) -> None:
        nonlocal tokens, cached, prompt_tokens
        async with sem:
            t0 = time.perf_counter()
            s = await client.completions.create(model="smollm2", prompt=text, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
            first = None
            async for ch in s:
                if first is None and ch.choices and ch.choices[0].text:
                    first = time.perf_counter() - t0
                if ch.usage is not None:
                    tokens += ch.usage.completion_tokens
                    prompt_tokens += ch.usage.prompt_tokens
                    d = ch.usage.prompt_tokens_details
                    cached += (d.cached_tokens or 0) if d else 0
            ttfts.append(first or 0.0)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(t) for t in texts])
    wall = time.perf_counter() - t0
    await client.close()
    return {"ttft_mean_ms": 1000 * statistics.mean(ttfts), "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "tok_s": tokens / wall, "req_s": len(texts) / wall, "cached_pct": 100 * cached / max(1, prompt_tokens)}


def bench(args: argparse.Namespace) -> list[tuple[str, float, dict[str, float]]]:
    rows = []
    for name, opts in SETUPS.items():
        engine = {"num_kv_blocks": 512, "max_num_seqs": 8, **opts.pop("engine", {})}
        cfg = StackConfig(port=free_port(), host="127.0.0.1", model="smollm2", engine=engine,
                          worker={"torch_threads": args.torch_threads}, heartbeat_interval_s=0.25,
                          log_dir=tempfile.mkdtemp(prefix="bench-disagg-"), **opts)
        with Stack(cfg) as stack:
            asyncio.run(run(stack.url, prompts(2, 16, 0.0, "warm"), 2, 2))
            for hit in args.hit_rates:
                texts = prompts(args.requests, args.prompt_words, hit, f"h{int(hit * 100)}")
                asyncio.run(run(stack.url, texts[:1], 1, 1))  # the shared prefix's first sighting
                rows.append((name, hit, asyncio.run(run(stack.url, texts[1:], args.concurrency, args.max_tokens))))
                print(f"{name:40s} hit {hit:4.0%}: {rows[-1][2]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=13)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hit-rates", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()
    rows = bench(args)
    print(f"\n{'setup':40s} {'hit':>5s} {'TTFT mean':>10s} {'TTFT p50':>9s} {'tok/s':>7s} {'req/s':>6s} {'cached':>7s}")
    for name, hit, r in rows:
        print(f"{name:40s} {hit:5.0%} {r['ttft_mean_ms']:8.0f}ms {r['ttft_p50_ms']:7.0f}ms {r['tok_s']:7.1f} "
              f"{r['req_s']:6.2f} {r['cached_pct']:6.0f}%")


if __name__ == "__main__":
    main()
