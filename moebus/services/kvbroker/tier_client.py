"""KVBrokerClient: the index client plus the broker's shared tiers (block put/get over NATS).

put -> False and get -> [] when the broker is gone: the caller recomputes instead.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Self

from nats.aio.client import Client as NATS

from moebus.engine.kv_tiers import TieredKVStore
from moebus.engine.kv_transfer import (
    KVBlock,
    KVPayload,
    KVTransferError,
    NatsKVTransport,
    NatsTransportConfig,
)
from moebus.shared.kv_index_client import BrokerUnavailable, KVIndexClient
from moebus.shared.kv_messages import BlockGet, BlockGetReply, KVSubjects

log = logging.getLogger(__name__)


class KVBrokerClient(KVIndexClient):
    def __init__(self, nc: NATS, holder: str, subjects: KVSubjects = KVSubjects(), timeout_s: float = 2.0,
                 transport: NatsKVTransport | None = None, chunk_bytes: int = 512 * 1024) -> None:
        """transport: where get replies arrive (default: a private inbox)."""
        super().__init__(nc, holder, subjects, timeout_s)
        self._tcfg = NatsTransportConfig(chunk_bytes=chunk_bytes, ack_timeout_s=timeout_s)
        self.transport = transport
        self._own_transport = transport is None

    async def start(self) -> Self:
        if self.transport is None:
            self.transport = await NatsKVTransport(self.nc, self.nc.new_inbox(), self._tcfg).start()
        return self

    async def close(self) -> None:
        if self._own_transport and self.transport is not None:
            await self.transport.close()

    async def put_blocks(self, hashes: list[int], blocks: list[KVBlock]) -> bool:
        """Offload blocks to the broker's tiers; True once it has stored them."""
        if not blocks:
            return True
        payload = KVPayload.from_blocks(blocks, hashes, int(blocks[0].layers[0][0].shape[0]))
        try:
            await self.transport.send(payload, self.subjects.put, f"put-{self.holder}-{uuid.uuid4().hex}")
            return True
        except KVTransferError as e:
            log.warning("offload to the KV broker failed: %s", e)
            return False

    async def get_blocks(self, hashes: list[int], timeout: float | None = None) -> list[KVBlock]:
        """The leading run of `hashes` the broker's tiers hold ([] on any failure)."""
        if not hashes:
            return []
        tid = f"get-{self.holder}-{uuid.uuid4().hex}"
        timeout = timeout or self.timeout_s
        try:
            reply = await self._request(self.subjects.get, BlockGet(hashes=hashes, reply_address=self.transport.address,
                                                                    transfer_id=tid), BlockGetReply, timeout)
            if not reply.num_blocks:
                return []
            payload = await self.transport.receive(tid, timeout)
        except (BrokerUnavailable, KVTransferError, ValueError) as e:
            log.warning("fetch from the KV broker failed: %s", e)
            return []
        if payload.block_hashes != hashes[: payload.num_blocks]:
            log.warning("KV broker sent blocks for other hashes; ignoring them")
            return []
        return [payload.block(i) for i in range(payload.num_blocks)]

    async def fetch_into(self, store: TieredKVStore, hashes: list[int], timeout: float | None = None) -> int:
        """Copy the broker's leading run of `hashes` (beyond what `store` has) into a local store;
        then `load_prefix(engine, request, store)` on the engine thread uses them."""
        have = store.longest_prefix(hashes)
        blocks = await self.get_blocks(hashes[have:], timeout)
        await asyncio.to_thread(lambda: [store.put(h, b) for h, b in zip(hashes[have:], blocks, strict=False)])
        return have + len(blocks)
