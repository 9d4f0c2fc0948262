"""The KV broker as the launcher runs it: its own process, flags from KVBrokerConfig, ready through
`ready` like every service, its stats on the service's `stats` and on `kvbroker.stats`, and
errors as ServiceError headers."""
from __future__ import annotations

import asyncio

from moebus.kv.broker_client import KVBrokerClient
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import HealthReply, PrefixQueryReply
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing


async def test_launcher_runs_the_broker_as_a_service(tmp_path) -> None:
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", kvbroker=True, heartbeat_interval_s=0.25,
                      kvbroker_args=["--cpu-bytes", "3M", "--disk-dir", str(tmp_path / "disk")],
                      log_dir=str(tmp_path / "logs"), ready_timeout_s=120)
    s = Subjects()
    with Stack(cfg) as stack:  # wait_ready: every instance, the broker included, answers `ready`
        assert stack.services["kvbroker-0"] == "kvbroker"
        bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
        try:
            health = await bus.request(s.health("kvbroker", "kvbroker-0"), Empty(), HealthReply, timeout=5)
            assert health.ready and health.status == "ok"
            stats = (await bus.request(s.stats("kvbroker", "kvbroker-0"), Empty(), Stats, timeout=5)).stats
            assert stats["tiers"]["cpu"]["capacity_bytes"] == 3 << 20 and "disk" in stats["tiers"]

            client = KVBrokerClient(bus, "worker-x", timeout_s=5)
            await client.publish(stored=[1, 2, 3])
            for _ in range(100):  # events and stats are separate subscriptions: no order between them
                if (await client.stats()).holders:
                    break
                await asyncio.sleep(0.02)
            assert (await client.stats()).holders == {"worker-x": 3}
            assert [(m.holder, m.num_blocks) for m in await client.query([1, 2, 4])] == [("worker-x", 2)]
            try:  # a malformed query is a typed error, not free text in a header
                await bus.request(s.kvbroker_query, b'{"hashes": "nope"}', PrefixQueryReply, timeout=5)
                raise AssertionError("the broker accepted a malformed query")
            except ServiceError as e:
                assert e.code is ErrorCode.BAD_REQUEST and "hashes" in e.message
        finally:
            await bus.drain()
    assert stack.procs["kvbroker-0"].returncode == 0  # SIGTERM: drained and exited cleanly
