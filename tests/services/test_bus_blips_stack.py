"""Streams survive bus blips with real processes: `moebus up`'s Stack (bus auth on: every process has
its own NATS user) restarts its nats-server on the same port with the same users, twice, while
twenty streams run; every stream ends whole, nothing moves, no worker is declared lost."""
from __future__ import annotations

import asyncio

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack

from .test_bus_blips import BOUND_S, STREAMS, metric, stream_stack, streams_under_blip, undisturbed

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow


@pytest.fixture
def stack(tmp_path):
    with Stack(stream_stack(str(tmp_path))) as s:
        yield s


async def test_nats_restarts_lose_no_stream_across_processes(stack: Stack) -> None:
    assert stack.users is not None  # bus auth is on: the restarted server must take the same users
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    balancer = f"http://127.0.0.1:{stack.metrics_ports['balancer-0'][1]}"  # its /metrics
    baseline = await undisturbed(client)
    replayed: list[float] = []  # per blip, replays the workers answered
    for down_s in (1.0, 5.0):
        before = await metric(stack.url, "moebus_frontend_replays_total", 'outcome="ok"')
        blip = await streams_under_blip(client, lambda d: asyncio.to_thread(stack.restart_nats, d), down_s)
        print("\nprocesses, " + blip.figures(baseline))
        assert [s.text for s in blip.streams] == [TOY_REPLY] * STREAMS
        assert blip.resumes and max(blip.resumes) < BOUND_S and blip.late(baseline) < BOUND_S
        await asyncio.sleep(2.5)  # past the balancer's settle time and three beats
        assert await metric(balancer, "moebus_balancer_workers_lost_total") == 0
        assert await metric(stack.url, "moebus_frontend_migrations_total") == 0
        replayed.append(await metric(stack.url, "moebus_frontend_replays_total", 'outcome="ok"') - before)
    print(f"replays: {await metric(stack.url, 'moebus_frontend_replays_total'):g}, answered per blip: {replayed}, "
          f"chunks replayed: {await metric(stack.url, 'moebus_frontend_replayed_chunks_total'):g}")
    # The frontend's bus user may ask the workers, and each worker answers: every stream, all of which outlive
    # the 1 s blip by seconds, was replayed after it. Not so after the 5 s one: a worker that reconnects after
    # the frontend sends the tail it buffered while cut off, which now arrives whole, and its streams may end
    # before their replay (refused: the worker was not subscribed yet) is asked again.
    assert replayed[0] >= STREAMS
    assert await metric(stack.url, "moebus_frontend_replays_total", 'outcome="error"') == 0
