"""Replay: open loop on the trace's own clock (optionally bounded in flight), or closed loop with
a fixed concurrency. Each finished request goes to `sink` at once, so an interrupted run keeps
what it had; requests cut off by an interrupt are recorded with error "cancelled"."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai
from tqdm import tqdm

from .client import RequestRecord, send
from .trace import TraceRequest


@dataclass(slots=True)
class Target:
    client: openai.AsyncOpenAI
    model: str


@dataclass(slots=True)
class Pacing:
    max_in_flight: int | None = None  # open loop: a request waits for a free slot (its lag is recorded)
    concurrency: int | None = None  # closed loop: this many requests always in flight, no clock

    def __post_init__(self) -> None:
        if (self.max_in_flight or 1) < 1 or (self.concurrency or 1) < 1:
            raise ValueError("max_in_flight and concurrency must be >= 1")


async def replay(target: Target, reqs: list[TraceRequest], prompts: list[str | None], pacing: Pacing,
                 sink: Callable[[RequestRecord], None], progress: bool = True) -> list[RequestRecord]:
    """Send every request; returns the records (in trace order)."""
    records = [RequestRecord(i, r.arrival_s, input_tokens=r.input_tokens, output_tokens=r.output_tokens)
               for i, r in enumerate(reqs)]
    bar = tqdm(total=len(reqs), unit="req", disable=not progress, dynamic_ncols=True)
    in_flight = 0
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal in_flight
        rec, req = records[i], reqs[i]
        in_flight += 1
        try:
            await send(target.client, target.model, rec, prompt=prompts[i], messages=req.messages, t0=t0)
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled"
            raise
        finally:
            in_flight -= 1
            if rec.done_s is None:
                rec.done_s = time.perf_counter() - t0
            sink(rec)
            bar.update(1)
            bar.set_postfix(in_flight=in_flight, refresh=False)

    tasks: list[asyncio.Task] = []
    try:
        if pacing.concurrency:
            await _closed_loop(records, pacing.concurrency, one, t0, tasks)
        else:
            await _open_loop(reqs, pacing.max_in_flight, one, t0, tasks)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    return records


async def _open_loop(reqs: list[TraceRequest], bound: int | None, one, t0: float, tasks: list) -> None:
    slots = asyncio.Semaphore(bound) if bound else None

    async def bounded(i: int) -> None:
        try:
            await one(i)
        finally:
            slots.release()

    for i, r in enumerate(reqs):
        delay = t0 + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(bounded(i) if slots else one(i)))


async def _closed_loop(records: list[RequestRecord], n: int, one, t0: float, tasks: list) -> None:
    queue = iter(range(len(records)))

    async def user() -> None:
        for i in queue:  # one shared iterator: each index goes to exactly one user
            records[i].scheduled_s = time.perf_counter() - t0
            await one(i)

    tasks.extend(asyncio.create_task(user()) for _ in range(min(n, len(records))))
