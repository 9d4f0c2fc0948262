"""Tokens/s with tracing on vs off: the same streamed chat workload through the whole stack (real
processes, as `moebus up` starts them), a fresh stack per run, alternating off / on, medians.

    flock /tmp/moebus-bench.lock python loadtest/bench_tracing.py --model toy --pairs 3
    flock /tmp/moebus-bench.lock python loadtest/bench_tracing.py --model smollm2 --pairs 3

"on" exports every request's spans (sample ratio 1) to a JSONL file (`moebus up --trace-file`);
"off" sets nothing (the services' providers sample nothing and export nothing). Greedy, EOS
ignored: every run produces the same number of tokens. Prints one line per run and the ratio of
the medians (on / off).

`--same-stack`: one traced stack, rounds alternating requests sent with a sampled `traceparent`
(recorded, exported) and an unsampled one (nothing recorded): no stack-to-stack variance, so on
a shared machine the per-request cost of the spans shows through the noise better.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import openai

from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port


async def workload(url: str, model: str, n: int, concurrency: int, out_len: int,
                   sampled: bool | None = None) -> tuple[int, float]:
    """sampled: send a traceparent with that decision (None: none)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
                max_tokens=out_len, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "min_tokens": out_len}, extra_headers=_traceparent(sampled, i))
            async for ch in stream:
                if ch.usage:
                    tokens += ch.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - t0
    await client.close()
    return tokens, seconds


def _traceparent(sampled: bool | None, i: int) -> dict[str, str]:
    if sampled is None:
        return {}
    return {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-{'01' if sampled else '00'}"}


def same_stack(args: argparse.Namespace, tmp: Path) -> None:
    trace_file = tmp / "spans.jsonl"
    extra = {} if args.model == "toy" else {"engine": {"max_num_seqs": args.concurrency}, "worker": {"torch_threads": 1}}
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model=args.model, heartbeat_interval_s=0.5,
                      log_dir=str(tmp / "logs"), trace_file=str(trace_file), ready_timeout_s=300, **extra)
    results: dict[bool, list[float]] = {False: [], True: []}
    with Stack(cfg) as stack:
        asyncio.run(workload(stack.url, args.model, args.concurrency, args.concurrency, 4, False))  # warm-up
        for k in range(args.pairs * 2):
            sampled = bool(k % 2)
            tokens, seconds = asyncio.run(workload(stack.url, args.model, args.requests, args.concurrency,
                                                   args.output_len, sampled))
            results[sampled].append(tokens / seconds)
            print(f"round {k}: {'sampled  ' if sampled else 'unsampled'} {tokens / seconds:8.1f} tok/s", flush=True)
    time.sleep(1)
    spans = sum(1 for _ in open(trace_file)) if trace_file.exists() else 0
    off, on = statistics.median(results[False]), statistics.median(results[True])
    print(f"same stack, model {args.model}, {args.requests} requests x {args.output_len} tokens, {args.concurrency} "
          f"at once: median unsampled {off:.1f} tok/s, sampled {on:.1f} tok/s, on/off = {on / off:.3f} "
          f"({spans} spans exported)")


def run(args: argparse.Namespace, traced: bool, tmp: Path, k: int) -> tuple[float, int]:
    """(tok/s, spans exported) of one fresh stack."""
    trace_file = tmp / f"spans-{k}.jsonl" if traced else None
    extra = {} if args.model == "toy" else {"engine": {"max_num_seqs": args.concurrency}, "worker": {"torch_threads": 1}}
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model=args.model, heartbeat_interval_s=0.5,
                      log_dir=str(tmp / f"logs-{k}"), trace_file=str(trace_file) if trace_file else None,
                      ready_timeout_s=300, **extra)
    with Stack(cfg) as stack:
        asyncio.run(workload(stack.url, args.model, args.concurrency, args.concurrency, 4))  # warm-up
        tokens, seconds = asyncio.run(workload(stack.url, args.model, args.requests, args.concurrency, args.output_len))
    spans = sum(1 for _ in open(trace_file)) if trace_file and trace_file.exists() else 0
    return tokens / seconds, spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="toy")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--same-stack", action="store_true", help="one traced stack, sampled vs unsampled rounds")
    args = p.parse_args()
    if args.same_stack:
        with tempfile.TemporaryDirectory(prefix="moebus-bench-tracing-") as tmp:
            same_stack(args, Path(tmp))
        return
    results: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="moebus-bench-tracing-") as tmp:
        for k in range(args.pairs * 2):
            traced = bool(k % 2)
            tok_s, spans = run(args, traced, Path(tmp), k)
            results[traced].append(tok_s)
            print(f"run {k}: tracing {'on ' if traced else 'off'} {tok_s:8.1f} tok/s" +
                  (f" ({spans} spans exported)" if traced else ""), flush=True)
    off, on = statistics.median(results[False]), statistics.median(results[True])
    print(f"model {args.model}, {args.requests} requests x {args.output_len} tokens, {args.concurrency} at once: "
          f"median off {off:.1f} tok/s, on {on:.1f} tok/s, on/off = {on / off:.3f}")


if __name__ == "__main__":
    main()
