"""Bus.flush's promise, on a real nats-server: every subscription made before it is on the wire
ahead of the PING whose PONG ends it (nats-py writes PING straight to the socket while a SUB waits
for its flusher task)."""
from __future__ import annotations

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.nats_server import NatsServer
from moebus.shared.service import Empty
from moebus.shared.tracing import Tracing


async def _handler(_: Empty, __: object) -> Empty:
    return Empty()


async def test_a_flush_ends_after_the_server_has_every_subscription_before_it(nats_server: NatsServer) -> None:
    bus = await Bus.connect(BusConfig(servers=[nats_server.url], name="flush-order"), Tracing("flush-order"))
    other = await Bus.connect(BusConfig(servers=[nats_server.url], name="flush-asker"), Tracing("flush-asker"))
    try:
        transport = bus.nc._transport
        wire: list[bytes] = []
        write, writelines = transport.write, transport.writelines
        transport.write = lambda data: wire.append(bytes(data)) or write(data)
        transport.writelines = lambda lines: wire.extend(bytes(x) for x in lines) or writelines(lines)
        try:
            for i in range(20):
                wire.clear()
                await bus.subscribe(f"flush.order.{i}", Empty, _handler)
                await bus.flush()
                sub = max(k for k, b in enumerate(wire) if b.startswith(b"SUB "))
                pings = [k for k, b in enumerate(wire) if b == b"PING\r\n"]
                assert pings and pings[-1] > sub, wire  # the last PING follows the SUB
                # and so the subscription answers another connection's request at once
                assert await other.request(f"flush.order.{i}", Empty(), Empty, timeout=5) == Empty()
        finally:
            transport.write, transport.writelines = write, writelines
    finally:
        await other.drain()
        await bus.drain()
