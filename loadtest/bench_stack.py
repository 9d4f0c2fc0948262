"""Per-token overhead of the full stack (HTTP -> frontend -> NATS -> balancer/worker -> engine) vs
the engine in-process, on the same workload, in the same run.

    python loadtest/bench_stack.py                       # 16 concurrent chat streams x 64 tokens
    python loadtest/bench_stack.py --concurrency 1 --requests 4

Greedy, EOS ignored, so both sides produce exactly the same number of tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import openai

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain gravity to a child.", "Name a famous painter.", "What is 12 times 12?"]


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]


async def run_stack(url: str, n: int, concurrency: int, out_len: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            stream = await client.chat.completions.create(
                model="smollm2", messages=_messages(i), max_tokens=out_len, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": out_len})
            first = None
            async for ch in stream:
                if first is None and ch.choices and ch.choices[0].delta.content:
                    first = time.perf_counter() - t0
                if ch.usage:
                    tokens += ch.usage.completion_tokens
            ttfts.append(first or 0.0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    dt = time.perf_counter() - t0
    return {"tok_s": tokens / dt, "tokens": tokens, "seconds": dt, "ttft": sum(ttfts) / len(ttfts)}


def run_engine(n: int, concurrency: int, out_len: int, engine_kwargs: dict) -> dict:
    eng = LLMEngine(EngineConfig(**engine_kwargs))
    tok = eng.tokenizer
    params = SamplingParams(temperature=0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
    prompts = [tok.encode(tok.apply_chat_template(_messages(i))) for i in range(n)]
    pending = list(enumerate(prompts))
    active: set[str] = set()
    tokens = 0
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            i, p = pending.pop(0)
            eng.add_request(f"e{i}", p, params)
            active.add(f"e{i}")
        for o in eng.step():
            tokens += len(o.new_token_ids)
            if o.finished:
                active.discard(o.request_id)
    dt = time.perf_counter() - t0
    return {"tok_s": tokens / dt, "tokens": tokens, "seconds": dt, "ttft": float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    engine_kwargs = {"max_num_seqs": args.concurrency}
    with tempfile.TemporaryDirectory() as logs:
        cfg = StackConfig(port=free_port(), host="127.0.0.1", engine=engine_kwargs, log_dir=logs,
                          max_queued=args.requests)
        with Stack(cfg) as stack:
            asyncio.run(run_stack(stack.url, 2, 2, 4))  # warm-up
            stack_r = asyncio.run(run_stack(stack.url, args.requests, args.concurrency, args.output_len))
    engine_r = run_engine(args.requests, args.concurrency, args.output_len, engine_kwargs)
    print(f"\nrequests={args.requests} concurrency={args.concurrency} output={args.output_len}")
    print(f"{'path':28s} {'out tok/s':>10s} {'ms/token':>9s} {'mean TTFT s':>12s}")
    for name, r in (("full stack (HTTP+NATS)", stack_r), ("engine in-process", engine_r)):
        print(f"{name:28s} {r['tok_s']:10.1f} {1000 / r['tok_s']:9.2f} {r['ttft']:12.3f}")
    print(f"per-token overhead ratio (stack ms/token / engine ms/token): {engine_r['tok_s'] / stack_r['tok_s']:.3f}x")


if __name__ == "__main__":
    main()
