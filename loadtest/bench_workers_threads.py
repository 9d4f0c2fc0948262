"""Run: flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bench_workers_threads.py before|after.
2 workers on this machine, 6 concurrent chat requests (64 tokens each, greedy, ignore_eos):
wall time and generated tok/s, with the workers' torch threads as given."""
import asyncio
import json
import sys
import time

from openai import AsyncOpenAI

from moebus.services.launcher import Stack, StackConfig
from moebus.services.startup import threads_per_worker
from moebus.shared.nats_server import free_port

mode = sys.argv[1]  # "before": torch's default threads per worker; "after": the split
worker = {"torch_threads": None} if mode == "before" else {"torch_threads": threads_per_worker(2)}
cfg = StackConfig(port=free_port(), host="127.0.0.1", model="smollm2", workers=2, worker=worker,
                  kvbroker=False, encoders=0, log_dir=f"/tmp/moebus-bench-workers-{mode}", balancer={"policy": "round_robin"})

async def one(c, k):
    r = await c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": f"Tell me a story about the number {k}."}],
                                        max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    return r.usage.completion_tokens

async def run(url):
    c = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    await one(c, 99)  # one request first
    out = []
    for _ in range(2):
        t = time.monotonic()
        toks = await asyncio.gather(*(one(c, k) for k in range(6)))
        dt = time.monotonic() - t
        out.append((dt, sum(toks) / dt))
    return out

with Stack(cfg) as s:
    res = asyncio.run(run(s.url))
print(json.dumps({"mode": mode, "torch_threads": worker["torch_threads"], "runs": [{"wall_s": round(a, 2), "tok_s": round(b, 1)} for a, b in res]}))
