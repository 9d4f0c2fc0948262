"""The parts behind surviving bus blips: the worker's replay buffer, liveness judged only on what a
service could hear (balancer table, planner fleet), the Bus's view of its own outages, and what
the frontend logs of them."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from types import SimpleNamespace

import pytest

from moebus.services.balancer.table import WorkerTable
from moebus.services.frontend.config import FrontendConfig
from moebus.services.frontend.routing.router import StreamRouter
from moebus.services.planner.fleet import Fleet
from moebus.services.worker.replay import ReplayBuffer
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages import Heartbeat, TokenChunk
from moebus.shared.messages.generate import ReplayReply, ReplayRequest
from moebus.shared.metrics import Metrics
from moebus.shared.nats_server import NatsServer
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import wait_for


def chunk(seq: int, index: int = 0, rid: str = "r", attempt: int = 0, **kw) -> TokenChunk:
    return TokenChunk(request_id=rid, worker_id="w", attempt=attempt, index=index, seq=seq, token_ids=[seq + 3], **kw)


def fill(buf: ReplayBuffer, rid: str = "r", n: int = 5, choices: int = 1, attempt: int = 0) -> None:
    buf.open(rid, attempt)
    for seq in range(n):
        for i in range(choices):
            c = chunk(seq, i, rid, attempt)
            buf.record(c, c.encode())


def seqs(reply: ReplayReply) -> list[tuple[int, int]]:
    return [(c.index, c.seq) for c in reply.chunks]


def test_replay_from_a_seq_per_choice_with_the_error_last() -> None:
    buf = ReplayBuffer()
    fill(buf, n=4, choices=2)
    err = TokenChunk(request_id="r", worker_id="w", finished=True, error="draining", retryable=True)
    buf.record(err, err.encode())
    reply = buf.replay(ReplayRequest(request_id="r", from_seq={0: 2, 1: 3}))
    assert not reply.gone and seqs(reply)[:3] == [(0, 2), (0, 3), (1, 3)] and reply.chunks[-1].error == "draining"
    assert ReplayReply.decode(reply.encode()) == reply  # round trip, int keys included
    assert ReplayRequest.decode(ReplayRequest(request_id="r", from_seq={1: 3}).encode()).from_seq == {1: 3}


def test_unknown_other_attempt_aborted_or_let_go_is_gone() -> None:
    buf = ReplayBuffer(max_chunks=3)
    assert buf.replay(ReplayRequest(request_id="r")).gone  # a restarted worker knows nothing
    fill(buf, n=5, attempt=1)
    assert buf.replay(ReplayRequest(request_id="r", attempt=0)).gone
    assert buf.replay(ReplayRequest(request_id="r", attempt=1, from_seq={0: 1})).gone  # seqs 0, 1 let go
    assert seqs(buf.replay(ReplayRequest(request_id="r", attempt=1, from_seq={0: 2}))) == [(0, 2), (0, 3), (0, 4)]
    buf.drop("r")  # aborted
    assert buf.replay(ReplayRequest(request_id="r", attempt=1, from_seq={0: 2})).gone and buf.size == 0
    buf.open("q", 0)  # accepted, nothing sent yet: known, nothing to give
    assert buf.replay(ReplayRequest(request_id="q", from_seq={0: 0})) == ReplayReply(request_id="q")


def test_finished_requests_stay_a_grace_time_and_bytes_are_capped(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    one = len(chunk(5).encode())  # the largest (seq 0 is left out on the wire)
    buf = ReplayBuffer(max_bytes=one * 12, grace_s=30)
    fill(buf, "a")
    buf.finish("a")
    fill(buf, "b")
    now[0] += 29
    assert not buf.replay(ReplayRequest(request_id="a", from_seq={0: 0})).gone
    now[0] += 2  # a's grace is over
    assert buf.replay(ReplayRequest(request_id="a", from_seq={0: 0})).gone and len(buf) == 1
    fill(buf, "c")
    buf.finish("c")
    fill(buf, "d")  # over the cap: the finished one goes first, then the oldest running one
    assert {r for r in "bcd" if not buf.replay(ReplayRequest(request_id=r)).gone} == {"b", "d"}
    fill(buf, "e", n=6)
    assert {r for r in "bde" if not buf.replay(ReplayRequest(request_id=r)).gone} == {"d", "e"}
    assert buf.size <= buf.max_bytes


def test_a_long_replay_comes_in_parts() -> None:
    buf = ReplayBuffer()
    fill(buf, n=10)
    one = len(chunk(5).encode())
    first = buf.replay(ReplayRequest(request_id="r", from_seq={0: 0}), max_reply_bytes=one * 4)
    assert first.more and seqs(first) == [(0, s) for s in range(4)]
    rest = buf.replay(ReplayRequest(request_id="r", from_seq={0: 4}), max_reply_bytes=one * 100)
    assert not rest.more and seqs(rest) == [(0, s) for s in range(4, 10)]


def beat(wid: str) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=wid, ts=0.0, interval_s=1.0, model="m")


def test_silence_we_could_not_hear_does_not_expire_workers() -> None:
    t, f = WorkerTable(missed_heartbeats=3), Fleet(missed_heartbeats=3, rate_window_s=10)
    for x in (t, f):
        x.observe(beat("a"), 0.0)
    assert t.expire(10.0, math.inf) == [] and f.expire(10.0, math.inf) == []  # cut off: nobody expires
    assert t.expire(12.9, 10.0) == [] and f.expire(12.9, 10.0) == []  # back at 10 (settled): 3 s allowed
    assert t.expire(13.1, 10.0) == ["a"] and f.expire(13.1, 10.0) == ["a"]


async def test_the_bus_knows_its_outages_and_tells_watchers() -> None:
    server = await asyncio.to_thread(NatsServer().start)
    bus = await Bus.connect(BusConfig(servers=[server.url], reconnect_time_wait_s=0.1, settle_s=1.0), Tracing("t"))
    seen: list[bool] = []
    bus.watch(seen.append)
    try:
        assert bus.evidence_since == -math.inf and bus.down_for() == 0
        port = server.port
        await asyncio.to_thread(server.stop)
        await wait_for(lambda: seen == [False])
        assert bus.evidence_since == math.inf and bus.down_for() > 0 and bus.outages == 1
        server = await asyncio.to_thread(NatsServer(port=port).start)
        await wait_for(lambda: seen == [False, True], timeout=5)
        assert bus.down_for() == 0 and bus.evidence_since == pytest.approx(time.monotonic() + 1.0, abs=0.5)
    finally:
        await bus.drain()
        await asyncio.to_thread(server.stop)


async def test_a_bus_that_gives_up_is_down_for_good() -> None:
    server = await asyncio.to_thread(NatsServer().start)
    bus = await Bus.connect(BusConfig(servers=[server.url], reconnect_time_wait_s=0.05, max_reconnect_attempts=1),
                            Tracing("t"))
    seen: list[bool] = []
    bus.watch(seen.append)
    try:
        await asyncio.to_thread(server.stop)
        # nats-py marks the client closed before its closed callback runs: wait for both.
        await wait_for(lambda: bus.nc.is_closed and len(seen) >= 2, timeout=5)
        assert seen == [False, False] and bus.down_for() == math.inf and bus.evidence_since == math.inf
    finally:
        await bus.drain()


async def test_the_frontend_warns_of_a_bus_drop_only_when_streams_may_be_lost(caplog) -> None:
    """Its own close at shutdown with no stream in flight is INFO (a clean SIGTERM logs no WARNING);
    its own close with streams in flight, or a drop it did not ask for, stays a WARNING."""
    caplog.set_level(logging.INFO, logger="moebus.services.frontend.routing.router")
    server = await asyncio.to_thread(NatsServer().start)
    buses: list[Bus] = []

    async def router() -> StreamRouter:
        buses.append(await Bus.connect(BusConfig(servers=[server.url], reconnect_time_wait_s=0.1), Tracing("t")))
        r = StreamRouter(buses[-1], Subjects(), "frontend-0", FrontendConfig(), Metrics("frontend"))
        await r.start()
        return r

    def bus_down() -> list[tuple[int, str]]:
        return [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.getMessage().startswith("bus down")]

    try:
        clean, busy, _ = await router(), await router(), await router()  # the third: the server goes
        busy.register(SimpleNamespace(request_id="r1", queue=asyncio.Queue()))
        await clean.bus.drain()
        await wait_for(lambda: len(bus_down()) == 1)
        await busy.bus.drain()
        await wait_for(lambda: len(bus_down()) == 2)
        await asyncio.to_thread(server.stop)
        await wait_for(lambda: len(bus_down()) == 3)
        assert bus_down() == [(logging.INFO, "bus down: 0 streams in flight"),
                              (logging.WARNING, "bus down: 1 streams in flight"),
                              (logging.WARNING, "bus down: 0 streams in flight")]
    finally:
        for bus in buses:
            await bus.drain()
        await asyncio.to_thread(server.stop)
