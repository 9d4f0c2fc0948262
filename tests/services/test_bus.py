"""Bus semantics on a real nats-server: typed replies, typed errors, no-responders vs timeouts."""
from __future__ import annotations

import asyncio
import time

import pytest

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import ErrorCode, NoResponders, RequestTimeout, ServiceError
from moebus.shared.messages import AbortRequest, GenerateAccepted
from moebus.shared.tracing import Tracing


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(BusConfig(servers=[nats_server.url], name="test"), Tracing("test"))
    yield b
    await b.drain()


async def test_request_reply_typed(bus: Bus) -> None:
    async def handler(req: AbortRequest, _msg) -> GenerateAccepted:
        return GenerateAccepted(request_id=req.request_id, worker_id="w")

    await bus.subscribe("t.bus.echo", AbortRequest, handler)
    await bus.flush()
    reply = await bus.request("t.bus.echo", AbortRequest(request_id="r1"), GenerateAccepted, timeout=2)
    assert reply == GenerateAccepted(request_id="r1", worker_id="w")


async def test_no_responders_is_not_a_timeout(bus: Bus) -> None:
    started = time.monotonic()
    with pytest.raises(NoResponders):
        await bus.request("t.bus.nobody", AbortRequest(request_id="r"), GenerateAccepted, timeout=5)
    assert time.monotonic() - started < 1, "no-responders must fail fast, not wait for the timeout"


async def test_timeout(bus: Bus) -> None:
    async def slow(_req: AbortRequest, _msg) -> None:
        await asyncio.sleep(1)  # longer than the request's timeout

    await bus.subscribe("t.bus.slow", AbortRequest, slow)
    await bus.flush()
    with pytest.raises(RequestTimeout) as e:
        await bus.request("t.bus.slow", AbortRequest(request_id="r"), GenerateAccepted, timeout=0.2)
    assert e.value.code is ErrorCode.TIMEOUT


async def test_service_errors_travel_as_headers(bus: Bus) -> None:
    async def overloaded(_req: AbortRequest, _msg) -> None:
        raise ServiceError(ErrorCode.OVERLOADED, "full", retry_after=3)

    async def crashes(_req: AbortRequest, _msg) -> None:
        raise RuntimeError("boom")

    await bus.subscribe("t.bus.full", AbortRequest, overloaded)
    await bus.subscribe("t.bus.crash", AbortRequest, crashes)
    await bus.flush()
    with pytest.raises(ServiceError) as e:
        await bus.request("t.bus.full", AbortRequest(request_id="r"), GenerateAccepted, timeout=2)
    assert (e.value.code, e.value.message, e.value.retry_after) == (ErrorCode.OVERLOADED, "full", 3)
    with pytest.raises(ServiceError) as e:
        await bus.request("t.bus.crash", AbortRequest(request_id="r"), GenerateAccepted, timeout=2)
    assert e.value.code is ErrorCode.INTERNAL and "boom" in e.value.message
    # An undecodable request is the caller's fault.
    with pytest.raises(ServiceError) as e:
        await bus.request("t.bus.full", b"not json", GenerateAccepted, timeout=2)
    assert e.value.code is ErrorCode.BAD_REQUEST


async def test_slow_handler_does_not_block_the_subject(bus: Bus) -> None:
    in_slow = asyncio.Event()

    async def handler(req: AbortRequest, _msg) -> GenerateAccepted:
        if req.request_id == "slow":
            in_slow.set()
            await asyncio.sleep(1.5)  # the slow handler: the fast request must not queue behind it
        return GenerateAccepted(request_id=req.request_id, worker_id="w")

    await bus.subscribe("t.bus.mixed", AbortRequest, handler)
    await bus.flush()
    slow = asyncio.create_task(bus.request("t.bus.mixed", AbortRequest(request_id="slow"), GenerateAccepted, 5))
    await asyncio.wait_for(in_slow.wait(), 5)
    started = time.monotonic()
    await bus.request("t.bus.mixed", AbortRequest(request_id="fast"), GenerateAccepted, timeout=2)
    assert time.monotonic() - started < 1
    await slow


async def test_queue_group_delivers_once(bus: Bus, nats_server) -> None:
    other = await Bus.connect(BusConfig(servers=[nats_server.url], name="other"), Tracing("other"))
    seen: list[str] = []

    async def handler(_req: AbortRequest, _msg) -> GenerateAccepted:
        seen.append("x")
        return GenerateAccepted(request_id="r", worker_id="w")

    await bus.subscribe("t.bus.q", AbortRequest, handler, queue="q")
    await other.subscribe("t.bus.q", AbortRequest, handler, queue="q")
    await other.flush()
    await bus.flush()
    for _ in range(10):
        await bus.request("t.bus.q", AbortRequest(request_id="r"), GenerateAccepted, timeout=2)
    assert len(seen) == 10
    await other.drain()
