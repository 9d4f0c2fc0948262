"""Concurrent routes keep their own outcome: one route's overloaded workers never turn another
route's "no live worker" (503) into a 429, nor the reverse."""
from __future__ import annotations

import asyncio
import time
import uuid

from nats.aio.msg import Msg

from moebus.services.balancer import BalancerConfig, BalancerService
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import GenerateAccepted, GenerateRequest, Heartbeat, Load
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import wait_for


class FakeWorker:
    """Answers `generate` with `code` once released, so a test decides when each reply lands."""

    def __init__(self, worker_id: str, model: str, code: ErrorCode) -> None:
        self.worker_id, self.model, self.code = worker_id, model, code
        self.asked, self.release = asyncio.Event(), asyncio.Event()

    async def generate(self, _: GenerateRequest, __: Msg) -> GenerateAccepted:
        self.asked.set()
        await self.release.wait()
        raise ServiceError(self.code, f"{self.worker_id}: {self.code.value}", retry_after=1)

    def beat(self) -> Heartbeat:
        return Heartbeat(service="worker", instance_id=self.worker_id, ts=time.time(), interval_s=60.0,
                         model=self.model, load=Load(max_waiting=8))


async def test_concurrent_routes_do_not_share_the_overloaded_flag(nats_server) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    s = Subjects(prefix)
    full = FakeWorker("full-0", "a", ErrorCode.OVERLOADED)  # model a: its only worker is overloaded -> 429
    gone = FakeWorker("gone-0", "b", ErrorCode.UNAVAILABLE)  # model b: its only worker is not live -> 503
    bus = await Bus.connect(BusConfig(servers=[nats_server.url], name="test"), Tracing("test"))
    cfg = BalancerConfig(nats_url=nats_server.url, subject_prefix=prefix, heartbeat_interval_s=0.1, kv_aware=False)
    try:
        async with BalancerService(cfg) as bal:
            for w in (full, gone):
                await bus.subscribe(s.worker_generate(w.worker_id), GenerateRequest, w.generate)
                await bus.publish(s.heartbeat("worker", w.worker_id), w.beat())
            await bus.flush()
            await wait_for(lambda: "full-0" in bal.table and "gone-0" in bal.table)

            async def route(model: str) -> ErrorCode:
                req = GenerateRequest(request_id=f"r-{model}", model=model, prompt_token_ids=[1, 2], reply_to="x.y")
                try:
                    await bus.request(s.balancer_route, req, GenerateAccepted, timeout=10)
                except ServiceError as e:
                    return e.code
                raise AssertionError("a route succeeded")

            a = asyncio.create_task(route("a"))
            await asyncio.wait_for(full.asked.wait(), 5)
            b = asyncio.create_task(route("b"))  # starts while route a waits on its worker
            await asyncio.wait_for(gone.asked.wait(), 5)
            full.release.set()  # a learns "overloaded" while b is still waiting
            assert await asyncio.wait_for(a, 5) is ErrorCode.OVERLOADED
            gone.release.set()
            assert await asyncio.wait_for(b, 5) is ErrorCode.UNAVAILABLE

            # The reverse order: b's reply lands first, then a's.
            for w in (full, gone):
                w.asked.clear()
                w.release.clear()
            b = asyncio.create_task(route("b"))
            await asyncio.wait_for(gone.asked.wait(), 5)
            a = asyncio.create_task(route("a"))
            await asyncio.wait_for(full.asked.wait(), 5)
            gone.release.set()
            assert await asyncio.wait_for(b, 5) is ErrorCode.UNAVAILABLE
            full.release.set()
            assert await asyncio.wait_for(a, 5) is ErrorCode.OVERLOADED
    finally:
        await bus.drain()
