"""A dying frontend's requests are aborted on the workers (issue #23 item 4): the frontend's
heartbeat is its lease (services/worker/leases.py). Unit rules, then real processes: the frontend
is SIGKILLed mid-stream and the worker frees its requests within the lease, not when they finish."""
from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time

import openai

from moebus.services.launcher import Stack, StackConfig
from moebus.services.worker.leases import FrontendLeases
from moebus.shared.bus import Bus
from moebus.shared.messages import Heartbeat
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

CHAT = [{"role": "user", "content": "hi"}]


def beat(frontend: str, incarnation: str) -> Heartbeat:
    return Heartbeat(service="frontend", instance_id=frontend, ts=0.0, interval_s=1.0, incarnation=incarnation)


def test_a_lease_is_lost_by_silence_heard_while_connected_or_by_a_restart() -> None:
    leases = FrontendLeases(lease_s=5.0)
    a, b = ("frontend-0", "inc-a"), ("frontend-1", "inc-b")
    leases.hold(a, now=0.0)
    leases.hold(b, now=0.0)
    leases.observe(beat("frontend-1", "inc-b"), now=4.0)
    assert leases.lost([a, b], now=5.0) == set()
    assert leases.lost([a, b], now=5.5) == {a}  # a: 5.5 s silent; b: heard at 4
    assert leases.lost([a, b], now=5.5, since=math.inf) == set()  # we are cut off: nobody is judged
    assert leases.lost([a, b], now=5.5, since=3.0) == set()  # back at 3: a is silent 2.5 s since
    assert leases.lost([a, b], now=9.5, since=3.0) == {a, b}
    leases.observe(beat("frontend-1", "inc-b2"), now=9.6)  # restarted: inc-b's streams have no reader
    assert leases.lost([b], now=9.7) == {b}
    assert leases.lost([("frontend-1", "inc-b2")], now=9.7) == set()
    # A request from a new incarnation before its first beat: the newer one holds the lease.
    leases.hold(("frontend-0", "inc-a2"), now=10.0)
    assert leases.lost([("frontend-0", "inc-a2")], now=10.0) == set() and leases.lost([a], now=10.0) == {a}
    assert FrontendLeases(lease_s=0).lost([a], now=1e9) == set()  # off
    assert leases.lost([("frontend-9", "x")], now=1e9) == set()  # never held here: not ours to judge


async def test_a_killed_frontends_requests_are_aborted_on_the_worker(tmp_path) -> None:
    lease_s = 2.0
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", workers=1, heartbeat_interval_s=0.2,
                      engine={"step_delay_s": 0.5, "max_num_seqs": 8},  # ~30 s a reply
                      worker={"frontend_lease_s": lease_s}, log_dir=str(tmp_path), ready_timeout_s=60)
    with Stack(cfg) as stack:  # bus auth on: the worker's user may hear frontend beats
        bus = await Bus.connect(stack.bus_config("test"), Tracing("test"))
        try:
            async def worker() -> dict:
                return (await bus.request(Subjects().stats("worker", "worker-0"), Empty(), Stats, timeout=5)).stats

            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
            streams = [await client.chat.completions.create(model="toy", messages=CHAT, stream=True, max_tokens=500)
                       for _ in range(4)]
            for s in streams:  # each past its first token
                async for c in s:
                    if c.choices and c.choices[0].delta.content:
                        break
            await asyncio.sleep(lease_s + 1)  # a live frontend keeps its lease
            before = await worker()
            assert before["active_requests"] == 4 and before["aborted"] == 0
            stack.kill("frontend-0", signal.SIGKILL)
            killed = time.monotonic()
            while (now := await worker())["active_requests"]:
                assert time.monotonic() - killed < lease_s + 8, now
                await asyncio.sleep(0.1)
            took = time.monotonic() - killed
            print(f"\nfrontend SIGKILLed: its 4 requests aborted on the worker after {took:.2f}s (lease {lease_s:g}s)")
            assert took > lease_s - 0.5  # not before the lease ran out
            assert now["aborted"] == 4
            engine = before["engine"]
            assert engine["num_running"] == 4 and engine["kv_blocks_free"] < engine["kv_blocks_total"]
            while (engine := (await worker())["engine"])["num_running"] or \
                    engine["kv_blocks_free"] != engine["kv_blocks_total"]:  # the engine let them go, KV freed
                assert time.monotonic() - killed < lease_s + 10, engine
                await asyncio.sleep(0.1)
            for s in streams:
                with contextlib.suppress(Exception):  # their server is gone
                    await s.response.aclose()
        finally:
            await bus.drain()
