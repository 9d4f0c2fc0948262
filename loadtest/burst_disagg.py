"""Issue #23 item 2: the disaggregated KV burst. 2 prefill + 2 decode workers on the real
SmolLM2 model (as `moebus up --mode disaggregated` runs it), 20 concurrent ~450-token prompts
the prefill workers have already cached, so their KV hand-offs land on the decode workers at
once; repeated --rounds times. Counts nats-server's slow-consumer disconnects (its log), failed
streams (an error, or fewer tokens than asked) and stalled ones (a silence after the first token
longer than --stall-s); the time to the first token (queueing for prefill) is reported apart.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/burst_disagg.py --rounds 10
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import openai

from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

TOPICS = ("rivers", "bridges", "glaciers", "comets", "orchards", "harbours", "violins", "deserts", "lighthouses",
          "volcanoes", "libraries", "railways", "beehives", "canals", "windmills", "forests", "reefs", "castles",
          "markets", "observatories")


def prompt(i: int, words: int) -> str:
    """About 2.2 tokens a word on SmolLM2's tokenizer: 200 words are about 450 tokens."""
    topic = TOPICS[i % len(TOPICS)]
    body = " ".join(f"{topic} note {k}: the {topic} of region {i} changed in year {1800 + k}." for k in range(words // 10))
    return f"Summarise these notes about {topic}. {body}"


async def one(c: openai.AsyncOpenAI, text: str, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    last: float | None = None  # the first chunk's arrival on
    gap = ttft = 0.0
    out = {"ok": 0.0, "prompt_tokens": 0.0, "cached": 0.0}
    try:
        s = await c.completions.create(model="smollm2", prompt=text, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ch in s:
            now = time.perf_counter()
            if last is None:
                ttft = now - t0
            gap, last = max(gap, now - (last or now)), now
            if ch.usage is not None:
                out["prompt_tokens"] = ch.usage.prompt_tokens
                d = ch.usage.prompt_tokens_details
                out["cached"] = (d.cached_tokens or 0) if d else 0
                out["ok"] = float(ch.usage.completion_tokens == max_tokens)
    except openai.APIError as e:
        print(f"  failed: {e}", flush=True)
    out["gap"], out["ttft"], out["wall"] = gap, ttft, time.perf_counter() - t0
    return out


async def burst(url: str, texts: list[str], max_tokens: int) -> list[dict[str, float]]:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    try:
        return list(await asyncio.gather(*[one(c, t, max_tokens) for t in texts]))
    finally:
        await c.close()


def slow_consumers(log_dir: str) -> int:
    """In nats-server's log (nats.log; nats-<i>.log per node of a launcher that runs a cluster)."""
    return sum(p.read_text(errors="replace").count("Slow Consumer Detected") for p in Path(log_dir).glob("nats*.log"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()
    log_dir = tempfile.mkdtemp(prefix="burst-disagg-")
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="smollm2", mode="disaggregated", prefill_workers=2,
                      decode_workers=2, worker={"torch_threads": args.torch_threads}, log_dir=log_dir)
    texts = [prompt(i, args.words) for i in range(args.concurrency)]
    rows = []
    with Stack(cfg) as stack:
        asyncio.run(burst(stack.url, texts, args.max_tokens))  # first sightings (uncounted): now cached
        for r in range(args.rounds):
            res = asyncio.run(burst(stack.url, texts, args.max_tokens))
            rows.append({"round": r, "failed": sum(1 for x in res if not x["ok"]),
                         "stalls": sum(1 for x in res if x["gap"] > args.stall_s),
                         "slow_consumers": slow_consumers(log_dir), "max_gap_s": max(x["gap"] for x in res),
                         "max_ttft_s": max(x["ttft"] for x in res), "p50_s": statistics.median(x["wall"] for x in res),
                         "max_s": max(x["wall"] for x in res),
                         "prompt_tokens": statistics.mean(x["prompt_tokens"] for x in res),
                         "cached_pct": 100 * sum(x["cached"] for x in res) / max(1, sum(x["prompt_tokens"] for x in res))})
            print(rows[-1], flush=True)
    total_stalls = sum(r["stalls"] for r in rows)
    print(f"\nlogs: {log_dir}\nrounds {len(rows)}, streams {len(rows) * len(texts)}, "
          f"failed {sum(r['failed'] for r in rows)}, stalls {total_stalls}, "
          f"slow-consumer disconnects {slow_consumers(log_dir)}, worst stream {max(r['max_s'] for r in rows):.1f}s, "
          f"median p50 {statistics.median(r['p50_s'] for r in rows):.1f}s")


if __name__ == "__main__":
    main()
