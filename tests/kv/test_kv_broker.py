"""KV broker: prefix index, the service over a real nats-server, and falling back when it dies."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from moebus.kv.block_client import KVBlockClient
from moebus.kv.hashing import kv_namespace, stable_block_hashes
from moebus.kv.index import PrefixIndex
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.load import load_prefix
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore
from moebus.services.kvbroker import KVBrokerConfig, KVBrokerService
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.errors import ServiceError
from moebus.shared.messages import HealthReply, KVEvent, WorkerLost
from moebus.shared.nats_server import NatsServer
from moebus.shared.service import Empty
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import run
from .test_kv_tiers import block, same


def test_index_longest_prefix_per_holder_and_tier():
    idx = PrefixIndex()
    idx.apply(KVEvent(holder="w1", stored=[1, 2, 3, 4]), now=0)
    idx.apply(KVEvent(holder="w2", stored=[1, 2, 9]), now=0)
    idx.apply(KVEvent(holder="w2", tier="cpu", stored=[1, 2, 3]), now=0)
    idx.apply(KVEvent(holder="w3", stored=[2, 3, 4]), now=0)  # no first block: no prefix at all
    got = [(m.holder, m.tier, m.num_blocks) for m in idx.longest_prefix([1, 2, 3, 4, 5])]
    assert got == [("w1", "device", 4), ("w2", "cpu", 3), ("w2", "device", 2)]
    assert [m.holder for m in idx.longest_prefix([1, 2], holders={"w2"})] == ["w2", "w2"]
    idx.apply(KVEvent(holder="w1", evicted=[3]), now=1)  # a hole ends w1's prefix
    assert idx.longest_prefix([1, 2, 3, 4])[0].num_blocks == 3 and idx.longest_prefix([1, 2, 3, 4])[0].holder == "w2"
    idx.apply(KVEvent(holder="w2", tier="cpu", stored=[7], snapshot=True), now=1)  # replaces w2/cpu
    assert ("w2", "cpu") not in {(m.holder, m.tier) for m in idx.longest_prefix([1])}
    idx.apply(KVEvent(holder="w1", cleared=True), now=2)
    assert idx.holder_sizes() == {"w2": 4, "w3": 3}
    assert sorted(idx.expire(now=32, ttl_s=30)) == ["w2", "w3"] and idx.holder_sizes() == {}


async def connect(url: str) -> Bus:
    return await Bus.connect(BusConfig(servers=[url], name="test"), Tracing("test"))


async def test_broker_service_index_queries_and_tier_put_get(nats_server, tmp_path):
    prefix = "moebus.v1"
    cfg = KVBrokerConfig(nats_url=nats_server.url, subject_prefix=prefix, cpu_bytes=2 * block(0).nbytes,
                         disk_dir=str(tmp_path), expire_interval_s=0.05, holder_ttl_s=30)
    bus = await connect(nats_server.url)
    nc = bus.nc
    async with KVBrokerService(cfg), KVBlockClient(bus, "worker-1") as w1, KVBlockClient(bus, "worker-2") as w2:
        await w1.publish(stored=[10, 11, 12])
        await w2.publish(stored=[10, 11])
        want = [("worker-1", 3), ("worker-2", 2)]
        async with asyncio.timeout(5):  # events and queries are separate subscriptions: no order between them
            while [(m.holder, m.num_blocks) for m in await w1.query([10, 11, 12, 13])] != want:
                await asyncio.sleep(0.01)

        blocks = [block(i) for i in range(3)]
        assert await w1.put_blocks([10, 11, 12], blocks)  # more than the CPU tier: spills to disk
        matches = await w2.query([10, 11, 12, 13])
        assert ("kvbroker", 3) in [(m.holder, m.num_blocks) for m in matches]
        got = await w2.get_blocks([10, 11, 12, 13])
        assert len(got) == 3 and all(same(a, b) for a, b in zip(got, blocks, strict=True))
        assert await w2.get_blocks([99]) == []

        await nc.publish(Subjects(prefix).balancer_worker_lost, WorkerLost(worker_id="worker-1").encode())
        await nc.flush()
        async with asyncio.timeout(5):
            while "worker-1" in (stats := await w1.stats()).holders:
                await asyncio.sleep(0.01)
        assert stats.holders["worker-2"] == 2
        assert stats.puts == 1 and stats.gets == 2 and stats.tiers["disk"]["blocks"] >= 1
        local = TieredKVStore([CpuTier(1 << 20)])
        assert await w1.fetch_into(local, [10, 11, 12]) == 3 and local.longest_prefix([10, 11, 12]) == 3
    await bus.drain()


def _start_broker(url: str) -> subprocess.Popen:
    """The broker process, once it answers `ready` (like every service)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "moebus.services.kvbroker", "--nats-url", url,
                             "--instance-id", "kvbroker-t", "--cpu-bytes", "256M"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)

    async def until_ready() -> bool:
        bus = await connect(url)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    await bus.request(Subjects().ready("kvbroker", "kvbroker-t"), Empty(), HealthReply, timeout=0.5)
                    return True
                except ServiceError:
                    await asyncio.sleep(0.1)
            return False
        finally:
            await bus.drain()

    if asyncio.run(until_ready()):
        return proc
    proc.kill()
    raise AssertionError(f"kvbroker did not start (exit code {proc.poll()})")


def test_broker_killed_midway_falls_back_to_recompute(engine_b, prompt, reference, nats_server):
    proc = _start_broker(nats_server.url)
    bm, ns = engine_b.block_manager, kv_namespace(engine_b)
    hashes = stable_block_hashes(prompt, 16, ns)[: (len(prompt) - 1) // 16]

    async def main() -> None:
        bus = await connect(nats_server.url)
        async with KVBlockClient(bus, "worker-b", Subjects(), timeout_s=1.0) as client:
            # Offload the prompt's blocks to the broker, as a worker would after prefill.
            bm.reset_prefix_cache()
            staged = TieredKVStore([CpuTier(64 << 20)])
            off = KVOffloader(staged)
            run(engine_b, "to-broker", prompt, after_step=lambda: off.offload(engine_b))
            held = staged.get_prefix(hashes)
            assert await client.put_blocks(hashes, held)
            m = await client.query(hashes)
            assert m and m[0].holder == "kvbroker" and m[0].num_blocks == len(hashes)

            # The happy path: fetch, load, prefix hit.
            bm.reset_prefix_cache()
            local = TieredKVStore([CpuTier(64 << 20)])
            assert await client.fetch_into(local, hashes) == len(hashes)
            hit = run(engine_b, "from-broker", prompt, before_step=lambda: load_prefix(engine_b, "from-broker", local))
            assert hit.tokens == reference and hit.computed < len(prompt)

            # The broker dies mid-way: queries and fetches degrade, the request recomputes.
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            bm.reset_prefix_cache()
            t0 = time.perf_counter()
            assert await client.query(hashes) is None
            empty = TieredKVStore([CpuTier(64 << 20)])
            assert await client.fetch_into(empty, hashes) == 0
            assert await client.put_blocks(hashes, held) is False
            assert time.perf_counter() - t0 < 3  # no-responders fail fast
            loaded: list[int] = []
            cold = run(engine_b, "after-kill", prompt,
                       before_step=lambda: loaded.append(load_prefix(engine_b, "after-kill", empty)))
            assert loaded == [0] and cold.tokens == reference and cold.computed == len(prompt) + 5
        await bus.drain()

    try:
        asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
        bm.reset_prefix_cache()


@pytest.mark.parametrize("size", ["512M", "4GiB", "1024", "2k"])
def test_cli_sizes(size):
    from moebus.services.kvbroker import parse_bytes

    assert parse_bytes(size) in (512 << 20, 4 << 30, 1024, 2048)
    assert KVBrokerConfig(cpu_bytes=size).cpu_bytes == parse_bytes(size)  # the --cpu-bytes flag takes units


async def test_broker_stops_cleanly_after_nats_died():
    """SIGTERM after the bus is gone: drain() would raise ConnectionReconnectingError, shutdown() closes."""
    server = NatsServer(jetstream=False).start()
    svc = await KVBrokerService(KVBrokerConfig(nats_url=server.url, cpu_bytes=1 << 20)).__aenter__()
    server.stop()
    for _ in range(100):  # until the client notices
        if not svc.bus.nc.is_connected:
            break
        await asyncio.sleep(0.05)
    assert not svc.bus.nc.is_connected
    await asyncio.wait_for(svc.shutdown(), timeout=10)
    assert svc.bus.nc.is_closed


def test_engine_transports_satisfy_the_shared_client_seam():
    """kv.broker_client types the seam it needs without importing torch: these must fit it."""
    from moebus.kv.broker_client import BlockPayload, BlockTransport
    from moebus.kv.payload import KVPayload
    from moebus.kv.transports.nats import NatsKVTransport
    from moebus.kv.transports.shm import ShmKVTransport

    assert isinstance(NatsKVTransport(None, "a.b"), BlockTransport)
    assert isinstance(ShmKVTransport(), BlockTransport)
    assert isinstance(KVPayload.from_blocks([block(0), block(1)], [1, 2], 4), BlockPayload)
