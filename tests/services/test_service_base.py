"""The Service base: control endpoints over NATS, heartbeats, HTTP probes, ordered shutdown."""
from __future__ import annotations

import aiohttp
import pytest

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import HealthReply, Heartbeat, Load
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Service, ServiceConfig, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import wait_for


class Dummy(Service):
    name = "dummy"

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.is_ready = False
        self.torn_down = False

    @property
    def ready(self) -> bool:
        return self.is_ready

    def load(self) -> Load:
        return Load(num_running=2)

    def stats(self) -> dict:
        return {"answer": 42}

    async def teardown(self) -> None:
        self.torn_down = self.bus.connected  # the bus must still be up here


@pytest.fixture
async def client(nats_server):
    b = await Bus.connect(BusConfig(servers=[nats_server.url], name="probe"), Tracing("probe"))
    yield b
    await b.drain()


async def test_control_endpoints_and_heartbeats(nats_server, client: Bus) -> None:
    s = Subjects()
    beats: list[Heartbeat] = []

    async def on_beat(b: Heartbeat, _msg) -> None:
        beats.append(b)

    await client.subscribe(s.heartbeat_all("dummy"), Heartbeat, on_beat, concurrent=False)
    port = free_port()
    cfg = ServiceConfig(nats_url=nats_server.url, instance_id="dummy-0", heartbeat_interval_s=0.05, http_port=port,
                        http_host="127.0.0.1")
    async with Dummy(cfg) as svc:
        health = await client.request(s.health("dummy", "dummy-0"), Empty(), HealthReply, timeout=2)
        assert health.status == "ok" and not health.ready
        with pytest.raises(ServiceError) as e:
            await client.request(s.ready("dummy", "dummy-0"), Empty(), HealthReply, timeout=2)
        assert e.value.code is ErrorCode.UNAVAILABLE
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                assert r.status == 503
            svc.is_ready = True
            async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                assert r.status == 200
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200 and (await r.json())["instance_id"] == "dummy-0"
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert "moebus_dummy_bus_messages_total" in await r.text()
        assert (await client.request(s.ready("dummy"), Empty(), HealthReply, timeout=2)).ready
        stats = await client.request(s.stats("dummy", "dummy-0"), Empty(), Stats, timeout=2)
        assert stats.stats == {"answer": 42}
        await wait_for(lambda: len(beats) >= 3)
    assert svc.torn_down
    assert len(beats) >= 3 and beats[0].load.num_running == 2
    assert beats[-1].draining, "the last heartbeat announces the shutdown"
