"""Client side of the KV broker, for workers (events, tier get/put) and balancers (queries).

Every call degrades instead of raising when the broker is gone: query -> None, get -> [],
put -> False, so the caller falls back to recomputing. Import this module from a worker or
balancer as the broker's client library (it never imports another service).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import Self

import nats.errors
from nats.aio.client import Client as NATS

from moebus.engine.kv_tiers import TieredKVStore
from moebus.engine.kv_transfer import (
    KVBlock,
    KVPayload,
    KVTransferError,
    NatsKVTransport,
    NatsTransportConfig,
)
from moebus.shared.codec import Message
from moebus.shared.kv_messages import (
    ERROR_HEADER,
    BlockGet,
    BlockGetReply,
    BrokerStats,
    KVEvent,
    KVSubjects,
    PrefixMatch,
    PrefixQuery,
    PrefixQueryReply,
    TierName,
)

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    pass


class KVBrokerClient:
    def __init__(self, nc: NATS, holder: str, subjects: KVSubjects = KVSubjects(), timeout_s: float = 2.0,
                 transport: NatsKVTransport | None = None, chunk_bytes: int = 512 * 1024) -> None:
        """holder: this process's id in the broker index (the worker's instance id). transport:
        where get replies arrive (default: a private inbox)."""
        self.nc, self.holder, self.subjects, self.timeout_s = nc, holder, subjects, timeout_s
        self._tcfg = NatsTransportConfig(chunk_bytes=chunk_bytes, ack_timeout_s=timeout_s)
        self.transport = transport
        self._own_transport = transport is None
        self._seq = 0

    async def start(self) -> Self:
        if self.transport is None:
            self.transport = await NatsKVTransport(self.nc, self.nc.new_inbox(), self._tcfg).start()
        return self

    async def close(self) -> None:
        if self._own_transport and self.transport is not None:
            await self.transport.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, subject: str, msg: Message | None, reply_type: type, timeout: float | None = None):
        try:
            body = msg.encode() if msg is not None else b""
            reply = await self.nc.request(subject, body, timeout=timeout or self.timeout_s)
        except nats.errors.NoRespondersError as e:
            raise BrokerUnavailable("no KV broker is running") from e
        except (TimeoutError, nats.errors.TimeoutError) as e:
            raise BrokerUnavailable("the KV broker did not answer in time") from e
        if reply.headers and ERROR_HEADER in reply.headers:
            raise ValueError(reply.headers[ERROR_HEADER])
        return reply_type.decode(reply.data)

    # --- events ----------------------------------------------------------------------------
    async def publish(self, stored: Iterable[int] = (), evicted: Iterable[int] = (), tier: TierName = "device",
                      snapshot: bool = False, cleared: bool = False) -> None:
        """Fire-and-forget; send a snapshot now and then so lost events heal."""
        self._seq += 1
        ev = KVEvent(holder=self.holder, tier=tier, stored=list(stored), evicted=list(evicted),
                     snapshot=snapshot, cleared=cleared, seq=self._seq)
        await self.nc.publish(self.subjects.events, ev.encode())

    # --- queries ---------------------------------------------------------------------------
    async def query(self, hashes: list[int], holders: Iterable[str] = ()) -> list[PrefixMatch] | None:
        """Longest prefix per (holder, tier), best first; None when the broker is unreachable."""
        try:
            reply = await self._request(self.subjects.query, PrefixQuery(hashes=hashes, holders=list(holders)),
                                        PrefixQueryReply)
        except BrokerUnavailable as e:
            log.warning("prefix query failed: %s", e)
            return None
        return reply.matches

    async def stats(self) -> BrokerStats | None:
        try:
            return await self._request(self.subjects.stats, None, BrokerStats)
        except BrokerUnavailable:
            return None

    # --- tier put / get --------------------------------------------------------------------
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
