"""KVBrokerService: the prefix-block index of every worker, plus shared CPU/disk KV tiers.

Endpoints (subjects in shared.kv_messages.KVSubjects):
  events  KVEvent from holders (stored / evicted / snapshot)     -> index
  query   PrefixQuery -> PrefixQueryReply (longest prefix per holder and tier, broker tiers included)
  put     a chunked KV transfer of blocks (KVPayload with block_hashes) -> broker tiers
  get     BlockGet -> BlockGetReply, then the blocks as a KV transfer to the requester
  stats   -> BrokerStats
A holder that the balancer reports lost, or that stays silent for holder_ttl_s, is forgotten.
Self-contained nats-py loop (no shared.Service): errors go back in a `Moebus-Error` header.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Self

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import ValidationError

from moebus.engine.kv_tiers import CpuTier, DiskTier, Tier, TieredKVStore
from moebus.engine.kv_transfer import KVPayload, KVTransferError, NatsKVTransport, NatsTransportConfig
from moebus.shared.codec import Message
from moebus.shared.kv_messages import (
    BROKER_HOLDER,
    ERROR_HEADER,
    BlockGet,
    BlockGetReply,
    BrokerStats,
    KVEvent,
    KVSubjects,
    PrefixMatch,
    PrefixQuery,
    PrefixQueryReply,
)
from moebus.shared.messages import WorkerLost
from moebus.shared.subjects import Subjects

from .config import KVBrokerConfig
from .index import PrefixIndex

log = logging.getLogger(__name__)


class KVBrokerService:
    def __init__(self, cfg: KVBrokerConfig, nc: NATS | None = None) -> None:
        self.cfg = cfg
        self.subjects = KVSubjects(cfg.prefix)
        self.index = PrefixIndex()
        tiers: list[Tier] = [CpuTier(cfg.cpu_bytes)]
        if cfg.disk_dir:
            tiers.append(DiskTier(cfg.disk_dir, cfg.disk_bytes, cfg.disk_fsync))
        self.store = TieredKVStore(tiers)
        self.counters = {"puts": 0, "gets": 0, "queries": 0}
        self.nc = nc
        self._own_nc = nc is None
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        tcfg = NatsTransportConfig(chunk_bytes=cfg.chunk_bytes)
        self._tcfg = tcfg
        self._receiver: NatsKVTransport | None = None
        self._sender: NatsKVTransport | None = None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> Self:
        if self.nc is None:
            self.nc = await nats.connect(self.cfg.nats_url, name="kvbroker", max_reconnect_attempts=-1,
                                         reconnect_time_wait=0.5)
        s = self.subjects
        self._receiver = await NatsKVTransport(self.nc, s.put, self._tcfg, on_payload=self._on_put).start()
        self._sender = NatsKVTransport(self.nc, None, self._tcfg)
        for subject, handler in ((s.events, self._on_event), (s.query, self._on_query), (s.get, self._on_get),
                                 (s.stats, self._on_stats),
                                 (Subjects(self.cfg.prefix).balancer_worker_lost, self._on_worker_lost)):
            self._subs.append(await self.nc.subscribe(subject, cb=self._guard(handler)))
        self._spawn(self._expirer())
        await self.nc.flush()
        log.info("kvbroker up on %s (%s)", self.cfg.nats_url, self.store.stats())
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._receiver is not None:
            await self._receiver.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_nc and self.nc is not None and not self.nc.is_closed:
            # Draining needs the server: with NATS gone (reconnecting) drain() raises, so just close.
            if self.nc.is_connected:
                await self.nc.drain()
            else:
                await self.nc.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _guard(self, handler: Callable[[Msg], Awaitable[Message | None]]) -> Callable[[Msg], Awaitable[None]]:
        async def cb(msg: Msg) -> None:
            try:
                reply = await handler(msg)
            except (ValidationError, ValueError) as e:
                if msg.reply:
                    await self.nc.publish(msg.reply, b"", headers={ERROR_HEADER: str(e)[:500]})
                return
            except Exception as e:
                log.exception("kvbroker handler failed on %s", msg.subject)
                if msg.reply:
                    await self.nc.publish(msg.reply, b"", headers={ERROR_HEADER: f"internal: {e}"[:500]})
                return
            if reply is not None and msg.reply:
                await self.nc.publish(msg.reply, reply.encode())
        return cb

    async def _expirer(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.expire_interval_s)
            for holder in self.index.expire(time.monotonic(), self.cfg.holder_ttl_s):
                log.info("forgot silent KV holder %s", holder)

    # --- endpoints -------------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        self.index.apply(KVEvent.decode(msg.data), time.monotonic())

    async def _on_worker_lost(self, msg: Msg) -> None:
        self.index.remove_holder(WorkerLost.decode(msg.data).worker_id)

    async def _on_query(self, msg: Msg) -> PrefixQueryReply:
        q = PrefixQuery.decode(msg.data)
        self.counters["queries"] += 1
        matches = self.index.longest_prefix(q.hashes, set(q.holders) if q.holders else None)
        n = self.store.longest_prefix(q.hashes)
        if n and (not q.holders or BROKER_HOLDER in q.holders):
            mine = PrefixMatch(holder=BROKER_HOLDER, tier=self.store.where(q.hashes[n - 1]) or "cpu", num_blocks=n)
            matches = sorted([*matches, mine], key=lambda m: (-m.num_blocks, m.holder, m.tier))
        return PrefixQueryReply(num_hashes=len(q.hashes), matches=matches)

    async def _on_get(self, msg: Msg) -> BlockGetReply:
        req = BlockGet.decode(msg.data)
        self.counters["gets"] += 1
        blocks = await asyncio.to_thread(self.store.get_prefix, req.hashes)
        if blocks:
            payload = KVPayload.from_blocks(blocks, req.hashes[: len(blocks)], int(blocks[0].layers[0][0].shape[0]))
            self._spawn(self._send(payload, req))
        return BlockGetReply(transfer_id=req.transfer_id, num_blocks=len(blocks))

    async def _send(self, payload: KVPayload, req: BlockGet) -> None:
        try:
            await self._sender.send(payload, req.reply_address, req.transfer_id)
        except KVTransferError as e:
            log.warning("could not deliver %s to %s: %s", req.transfer_id, req.reply_address, e)

    async def _on_put(self, transfer_id: str, payload: KVPayload) -> None:
        n = min(payload.num_blocks, len(payload.block_hashes))
        self.counters["puts"] += 1

        def store() -> None:
            for i in range(n):
                self.store.put(payload.block_hashes[i], payload.block(i))
        await asyncio.to_thread(store)

    async def _on_stats(self, msg: Msg) -> BrokerStats:
        return BrokerStats(holders=self.index.holder_sizes(), tiers=self.store.stats(), **self.counters)
