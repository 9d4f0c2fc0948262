"""KV broker integrity: a block damaged in its CPU tier, on its disk, in a put or on the way to a
worker is never served; the broker counts it in kv_blocks_corrupt_total{tier}."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from moebus.kv.block_client import KVBlockClient
from moebus.kv.payload import KVPayload
from moebus.kv.transports.nats import NatsKVTransport
from moebus.services.kvbroker import KVBrokerConfig, KVBrokerService
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .test_kv_integrity import block_data_pos, data_range, flip, flip_file
from .test_kv_tiers import block, same

PREFIX = "moebus.v1"


def corrupt_count(svc: KVBrokerService, tier: str) -> float:
    return svc.metrics.registry.get_sample_value("moebus_kvbroker_kv_blocks_corrupt_total", {"tier": tier}) or 0


@asynccontextmanager
async def broker_and_worker(nats_url: str, disk: Path, dropped: list[int]
                            ) -> AsyncIterator[tuple[KVBrokerService, KVBlockClient, Bus]]:
    """A broker with room for 3 blocks in memory (the rest spill to `disk`) and a worker's client
    of it (blocks it drops as damaged: their positions appended to `dropped`)."""
    cfg = KVBrokerConfig(nats_url=nats_url, subject_prefix=PREFIX, cpu_bytes=3 * block(0).nbytes,
                         disk_dir=str(disk), expire_interval_s=0.05)
    bus = await Bus.connect(BusConfig(servers=[nats_url], name="test"), Tracing("test"))
    try:
        async with KVBrokerService(cfg) as svc, \
                KVBlockClient(bus, "w", Subjects(PREFIX), on_corrupt=dropped.append) as w:
            yield svc, w, bus
    finally:
        await bus.drain()
        await asyncio.sleep(0)


async def test_broker_serves_only_intact_blocks_and_counts_the_rest(nats_server, tmp_path):
    dropped: list[int] = []
    async with broker_and_worker(nats_server.url, tmp_path, dropped) as (svc, w, bus):
        blocks = [block(i) for i in range(6)]
        assert await w.put_blocks(list(range(6)), blocks)  # 0..2 spill to disk, 3..5 stay in memory
        cpu, disk = svc.store.tiers
        assert sorted(disk.keys()) == [0, 1, 2] and sorted(cpu.keys()) == [3, 4, 5]

        cpu._blocks[4].layers[1][0].view(torch.uint8).view(-1)[9] ^= 0x04  # host memory, in place
        got = await w.get_blocks([3, 4, 5])
        assert len(got) == 1 and same(got[0], blocks[3]) and corrupt_count(svc, "cpu") == 1 and 4 not in cpu

        lo, hi = data_range(blocks[1])
        flip_file(tmp_path / f"{1:016x}.kvb", (lo + hi) // 2, 7)  # a bit of tensor data on disk
        got = await w.get_blocks([0, 1, 2])
        assert len(got) == 1 and same(got[0], blocks[0]) and corrupt_count(svc, "disk") == 1
        assert not (tmp_path / f"{1:016x}.kvb").exists()
        stats = await w.stats()
        assert stats.tiers["cpu"]["corrupt"] == 1 and stats.tiers["disk"]["corrupt"] == 1

        # A put whose third block was damaged before it left the worker: the two before it are kept.
        p = KVPayload.from_blocks([block(i) for i in range(10, 14)], list(range(10, 14)), 4)
        body = p.to_bytes()
        flip(body, block_data_pos(p, 2), 2)
        await NatsKVTransport(bus.nc, None).send_bytes(body, Subjects(PREFIX).kvbroker_put, "put-damaged")
        assert svc.store.longest_prefix(list(range(10, 14))) == 2 and corrupt_count(svc, "transfer") == 1

        # Damaged on the way back to the worker: the worker keeps the blocks before it.
        send = svc._sender.send

        async def damaging(payload: KVPayload, dest: str, tid: str) -> None:
            buf = payload.to_bytes()
            flip(buf, block_data_pos(payload, 1))
            await svc._sender.send_bytes(buf, dest, tid)

        svc._sender.send = damaging
        got = await w.get_blocks([10, 11])
        svc._sender.send = send
        assert len(got) == 1 and same(got[0], block(10)) and dropped == [1]
        assert "moebus_kvbroker_kv_blocks_corrupt_total" in svc.metrics.render().decode()
