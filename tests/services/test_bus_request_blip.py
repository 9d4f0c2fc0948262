"""A request in flight when the bus connection drops: its reply may never come (nats-py leaves it
waiting out its whole timeout: a frontend's detokenize call stalled a stream 8.9 s after a 1 s blip). An idempotent one is asked again at once (answered after the
reconnect); another waits as before, since its responder may still answer after the reconnect."""
from __future__ import annotations

import asyncio
import re

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import RequestTimeout
from moebus.shared.messages import Heartbeat
from moebus.shared.nats_server import NatsServer
from moebus.shared.tracing import Tracing

from .conftest import wait_for

SUBJECT = "moebus.v1.test.echo"


async def _blip_under_a_request(idempotent: bool, wait_s: float, late: bool = False
                                ) -> tuple[list[str], BaseException | None]:
    """A responder that leaves the first request unanswered (as if the server died with it), or
    answers it only once the server is back (`late`); the server restarts while the caller waits
    on it. What the responder saw, and the caller's error."""
    server = await asyncio.to_thread(NatsServer().start)
    cfg = BusConfig(servers=[server.url], reconnect_time_wait_s=0.1)
    responder, caller = [await Bus.connect(cfg, Tracing("t")) for _ in range(2)]
    seen: list[str] = []
    back = asyncio.Event()

    async def handle(beat: Heartbeat, _) -> Heartbeat | None:
        seen.append(beat.instance_id)
        if len(seen) > 1:
            return beat
        if late:
            await back.wait()
            await wait_for(lambda: responder.connected and caller.connected)
            return beat
        return None

    await responder.subscribe(SUBJECT, Heartbeat, handle)  # (concurrent: handled in a task of its own)
    await responder.flush()
    beat = Heartbeat(instance_id="a", service="t", ts=0, interval_s=1)
    ask = asyncio.create_task(caller.request(SUBJECT, beat, Heartbeat, timeout=30, wait_for_responders_s=wait_s,
                                             idempotent=idempotent))
    try:
        await wait_for(lambda: seen == ["a"] or ask.done(), timeout=20)
        assert not ask.done(), f"the request ended before the blip: {ask.exception()!r}"
        assert seen == ["a"], seen
        port = server.port
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(0.3)  # the blip: no server at all for a moment
        server = await asyncio.to_thread(NatsServer(port=port).start)
        back.set()
        try:  # well within the request's 30 s timeout
            reply = await asyncio.wait_for(asyncio.shield(ask), 10)
            assert reply.instance_id == "a"
            return seen, None
        except (TimeoutError, RequestTimeout) as e:
            return seen, e
    finally:
        ask.cancel()
        for bus in (responder, caller):
            await bus.drain()
        await asyncio.to_thread(server.stop)


async def test_an_idempotent_request_cut_by_a_blip_is_asked_again() -> None:
    seen, err = await _blip_under_a_request(idempotent=True, wait_s=30)
    assert err is None and seen == ["a", "a"]


async def test_an_idempotent_request_with_no_time_left_fails_at_once() -> None:
    seen, err = await _blip_under_a_request(idempotent=True, wait_s=0)
    assert isinstance(err, RequestTimeout) and seen == ["a"]


async def test_another_request_still_takes_a_reply_that_comes_after_the_reconnect() -> None:
    seen, err = await _blip_under_a_request(idempotent=False, wait_s=30, late=True)
    assert err is None and seen == ["a"]


async def test_an_idempotent_timeout_reports_the_whole_wait() -> None:
    """Asked again every 0.2 s for 1 s with nobody answering: the error names the 1 s waited, not
    one ask's 0.2 s."""
    server = await asyncio.to_thread(NatsServer().start)
    bus = await Bus.connect(BusConfig(servers=[server.url]), Tracing("t"))
    asks = []

    async def swallow(beat: Heartbeat, _) -> None:
        asks.append(beat.instance_id)
    try:
        await bus.subscribe(SUBJECT, Heartbeat, swallow)
        beat = Heartbeat(instance_id="a", service="t", ts=0, interval_s=1)
        try:
            await bus.request(SUBJECT, beat, Heartbeat, timeout=0.2, wait_for_responders_s=1.0, idempotent=True)
        except RequestTimeout as e:
            err = e
        assert 1.0 <= float(re.search(r"within ([\d.]+)s", str(err)).group(1)) < 3.0, str(err)
        assert len(asks) >= 4
    finally:
        await bus.drain()
        await asyncio.to_thread(server.stop)
