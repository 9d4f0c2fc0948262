"""Pauses (issue 36 item 1): SIGSTOP, then SIGCONT after 5, 20 or 60 s, of each process kind of
`moebus up`'s Stack (real processes, bus auth on) and of every process at once (a machine freeze),
while 20 streams run: none lost, each the whole undisturbed (greedy) reply, no worker declared
lost and nothing moved, since nobody is really gone. A pause is not a death: a worker's silence
moves its requests only once the bus says its connection is closed (balancer liveness).

The default tier pauses a worker and freezes everything for 5 s; `slow` runs the whole matrix.
`-s` prints one line per pause (RELIABILITY.md's figures)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack

from .test_bus_blips import STREAMS, metric, stream_stack, streams_under_blip, undisturbed

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

KINDS = ("worker-0", "balancer-0", "tokenizer-0", "frontend-0", "kvbroker-0", "planner-0", "nats")
EVERYONE = "everyone"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pauses")
    with Stack(stream_stack(str(logs), kvbroker=True, autoscale=(2, 2))) as s:
        yield s


def _pids(stack: Stack, victim: str) -> list[int]:
    nats = [n._proc.pid for n in stack.nats_procs.values() if n._proc is not None]
    if victim == "nats":
        return nats
    if victim == EVERYONE:
        return [*nats, *(p.pid for p in stack.procs.values())]
    return [stack.procs[victim].pid]


async def _pause(stack: Stack, victim: str, seconds: float) -> float:
    pids = _pids(stack, victim)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(seconds)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    return time.monotonic()


async def _check(stack: Stack, victim: str, seconds: float) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=seconds + 60)
    balancer = f"http://127.0.0.1:{stack.metrics_ports['balancer-0'][1]}"
    lost0 = await metric(balancer, "moebus_balancer_workers_lost_total")
    moved0 = await metric(stack.url, "moebus_frontend_migrations_total")
    baseline = await undisturbed(client)
    blip = await streams_under_blip(client, lambda d: _pause(stack, victim, d), seconds)
    print(f"\npause {victim} {seconds:g}s: " + blip.figures(baseline))
    assert [s.text for s in blip.streams] == [TOY_REPLY] * STREAMS
    await asyncio.sleep(1.0)  # three beats after the pause
    assert await metric(balancer, "moebus_balancer_workers_lost_total") == lost0, "a paused worker was declared lost"
    assert await metric(stack.url, "moebus_frontend_migrations_total") == moved0, "a request moved"
    assert all(p.poll() is None for p in stack.procs.values()), "a process died"


@pytest.mark.parametrize("victim", ["worker-0", EVERYONE])
async def test_a_pause_loses_nothing_and_moves_nothing(stack: Stack, victim: str) -> None:
    await _check(stack, victim, 5.0)


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [5.0, 20.0, 60.0])
@pytest.mark.parametrize("victim", [*KINDS, EVERYONE])
async def test_every_kind_paused(stack: Stack, victim: str, seconds: float) -> None:
    await _check(stack, victim, seconds)
