"""Migration with real processes on the toy engine: streams that are mid-flight when their worker
is SIGKILLed, SIGTERMed or drained over the bus go on, on the other worker, from the tokens the
client already has: every response is whole, no token repeated or missing (the toy's reply is
byte-level, so multi-byte characters are cut mid-character too)."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages import HealthReply
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .test_failover import migrations, wait_accepted

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

CHAT = [{"role": "user", "content": "hi"}]
ENGINE = {"step_delay_s": 0.04, "max_num_seqs": 16}  # ~2.5 s a reply: the cut lands mid-stream


def _toy_stack(tmp_path, **cfg) -> Iterator[Stack]:
    with Stack(StackConfig(port=free_port(), host="127.0.0.1", model="toy", workers=2, heartbeat_interval_s=0.2,
                           engine=ENGINE, log_dir=str(tmp_path), ready_timeout_s=60, **cfg)) as s:
        yield s


@pytest.fixture
def stack(tmp_path):
    yield from _toy_stack(tmp_path, worker={"drain_grace_s": 0.3})


class Reader:
    """One streamed chat completion read to its end: text per choice, usage, chunk count."""

    def __init__(self, stream: openai.AsyncStream) -> None:
        self.stream, self.text, self.usage = stream, {}, None

    async def first(self) -> None:
        """Read until some text arrived (the request is past its first token)."""
        async for ch in self.stream:
            if self._take(ch):
                return

    async def rest(self) -> Reader:
        async for ch in self.stream:
            self._take(ch)
        return self

    def _take(self, ch) -> bool:
        if ch.usage is not None:
            self.usage = ch.usage
        got = False
        for c in ch.choices:
            if c.delta.content:
                self.text[c.index] = self.text.get(c.index, "") + c.delta.content
                got = True
        return got


async def _start(c: openai.AsyncOpenAI, k: int, n: int = 1) -> Reader:
    r = Reader(await c.chat.completions.create(model="toy", messages=CHAT, max_tokens=500, stream=True, n=n,
                                               stream_options={"include_usage": True}))
    await r.first()
    return r


async def test_sigkill_mid_stream_every_stream_completes_whole(stack: Stack) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    undisturbed = await (await _start(c, 0)).rest()
    readers = await asyncio.gather(*(_start(c, k) for k in range(12)), _start(c, 12, n=2))
    whole = [asyncio.create_task(c.chat.completions.create(model="toy", messages=CHAT, max_tokens=500))
             for _ in range(4)]
    await wait_accepted(stack, {"worker-0": 3, "worker-1": 3})
    stack.kill("worker-0", signal.SIGKILL)
    done = await asyncio.wait_for(asyncio.gather(*(r.rest() for r in readers)), 30)
    for r in done:
        assert set(r.text.values()) == {TOY_REPLY}, r.text
        assert r.usage.completion_tokens == undisturbed.usage.completion_tokens * len(r.text)
    for resp in await asyncio.wait_for(asyncio.gather(*whole), 30):
        assert resp.choices[0].message.content == TOY_REPLY
    assert await migrations(stack, "resumed") >= 3  # worker-0's started streams went on elsewhere


@pytest.mark.parametrize("how", ["sigterm", "drain subject"])
async def test_drain_hands_started_streams_over(stack: Stack, how: str) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    readers = await asyncio.gather(*(_start(c, k) for k in range(8)))
    await wait_accepted(stack, {"worker-0": 2, "worker-1": 2})
    if how == "sigterm":
        stack.kill("worker-0", signal.SIGTERM)
    else:
        bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
        try:
            reply = await bus.request(Subjects().drain("worker", "worker-0"), Empty(), HealthReply, 2)
            assert reply.instance_id == "worker-0"
        finally:
            await bus.drain()
    done = await asyncio.wait_for(asyncio.gather(*(r.rest() for r in readers)), 15)
    assert [r.text for r in done] == [{0: TOY_REPLY}] * 8
    assert stack.procs["worker-0"].wait(15) == 0  # drained, not crashed
    assert await migrations(stack, "resumed") >= 1  # the grace (0.3 s) is shorter than a reply


@pytest.fixture
def patient_stack(tmp_path):
    """The balancer waits 20 s (100 missed heartbeats) before it calls a silent worker lost."""
    yield from _toy_stack(tmp_path, balancer={"missed_heartbeats": 100})


async def test_a_worker_restarted_under_its_own_id_loses_nothing(patient_stack: Stack) -> None:
    """A supervisor restarts a killed worker at once, under the same id, long before the balancer
    would miss its heartbeats: the new process's first heartbeat (a new incarnation) tells the
    balancer the old one's requests are gone, so its streams move on within seconds."""
    stack = patient_stack
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    readers = await asyncio.gather(*(_start(c, k) for k in range(8)))
    await wait_accepted(stack, {"worker-0": 2, "worker-1": 2})
    stack.kill("worker-0", signal.SIGKILL)
    stack.procs["worker-0"].wait(5)
    stack.respawn("worker-0")
    started = asyncio.get_running_loop().time()
    done = await asyncio.wait_for(asyncio.gather(*(r.rest() for r in readers)), 30)
    assert [r.text for r in done] == [{0: TOY_REPLY}] * 8
    # The restart, not the 20 s expiry: nothing moves before 20 s on that path. The bound leaves room
    # for the new process's start and warm-up and for the dead worker's 4 requests resumed one at a
    # time (the poison guard), ~2.5 s each on a loaded 2-core box.
    assert asyncio.get_running_loop().time() - started < 19
    assert await migrations(stack, "resumed") >= 1
