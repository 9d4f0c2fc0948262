"""KVBlockClient: the KV broker's shared tiers in KV blocks (a KVBrokerClient, broker_client.py, that
moves KVBlocks over a NATS transport of its own). Every call degrades: put_blocks -> False and
get_blocks -> [] when the broker is gone, and the caller recomputes."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Self

from nats.aio.client import Client as NATS

from moebus.kv.broker_client import KVBrokerClient
from moebus.kv.payload import KVBlock, KVPayload, block_size_of
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.transports.nats import NatsKVTransport, NatsTransportConfig
from moebus.shared.bus import Bus
from moebus.shared.subjects import Subjects

log = logging.getLogger(__name__)


class KVBlockClient(KVBrokerClient[KVPayload]):
    """The broker's shared tiers in KV blocks, over a private NATS inbox of this process.

    put_blocks -> False and get_blocks -> [] when the broker is gone: the caller recomputes."""

    def __init__(self, bus: Bus, holder: str, subjects: Subjects = Subjects(), timeout_s: float = 2.0,
                 chunk_bytes: int = 512 * 1024, on_corrupt: Callable[[int], None] | None = None,
                 kv_nc: NATS | None = None, credit_bytes: int = 16 * 1024 * 1024) -> None:
        """on_corrupt(n): n fetched blocks failed their checksum (dropped with all after them);
        kv_nc: the connection blocks move on (default: the bus's); credit_bytes: what may be in
        flight to this client's inbox."""
        super().__init__(bus, holder, subjects, timeout_s)
        self._tcfg = NatsTransportConfig(chunk_bytes=chunk_bytes, ack_timeout_s=timeout_s, credit_bytes=credit_bytes,
                                         grant_bytes=max(chunk_bytes, min(4 * 1024 * 1024, credit_bytes)))
        self.on_corrupt = on_corrupt
        self.kv_nc = kv_nc or bus.nc

    async def start(self) -> Self:
        if self.transport is None:
            self.transport = await NatsKVTransport(self.kv_nc, self.kv_nc.new_inbox(), self._tcfg).start()
        return self

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()

    async def put_blocks(self, hashes: list[int], blocks: list[KVBlock]) -> bool:
        """Offload blocks to the broker's tiers; True once it has stored them."""
        if not blocks:
            return True
        return await self.put(KVPayload.from_blocks(blocks, hashes, block_size_of(blocks)))

    async def get_blocks(self, hashes: list[int], timeout: float | None = None,
                         fingerprint: int = 0) -> list[KVBlock]:
        """The leading run of `hashes` the broker's tiers hold ([] on any failure). Each block
        was checked against its hash on decode; fingerprint (the caller's kv_fingerprint, 0: any):
        blocks made for another model or cache layout are dropped and counted like damaged ones."""
        payload = await self.get(hashes, timeout)
        if payload is None:
            return []
        corrupt = payload.corrupt_blocks
        if corrupt:
            log.warning("%d KV blocks from the broker failed their checksum; using the %d before the first",
                        corrupt, payload.num_blocks)
        blocks = [payload.block(i) for i in range(payload.num_blocks)]
        if fingerprint and payload.fingerprint and payload.fingerprint != fingerprint:
            log.warning("%d KV blocks from the broker are of another model or cache layout; dropped", len(blocks))
            corrupt, blocks = corrupt + len(blocks), []
        if corrupt and self.on_corrupt is not None:
            self.on_corrupt(corrupt)
        return blocks

    async def fetch_into(self, store: TieredKVStore, hashes: list[int], timeout: float | None = None,
                         fingerprint: int = 0) -> int:
        """Copy the broker's leading run of `hashes` (beyond what `store` has) into a local store;
        then `load_prefix(engine, request, store)` on the engine thread uses them."""
        have = store.longest_prefix(hashes)
        blocks = await self.get_blocks(hashes[have:], timeout, fingerprint)
        await asyncio.to_thread(lambda: [store.put(h, b) for h, b in zip(hashes[have:], blocks, strict=False)])
        return have + len(blocks)
