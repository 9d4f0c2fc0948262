"""KVBrokerService: the prefix-block index of every worker, plus shared CPU/disk KV tiers.

Endpoints (Subjects.kvbroker_*; messages in shared.messages.kvbroker; the client is
kv.broker_client.KVBrokerClient):
  events  KVEvent from holders (stored / evicted / snapshot)     -> index; and the broker's own: what its
          tiers store or lose (holder BROKER_HOLDER, a snapshot every snapshot_s), so balancers'
          own indexes (balancer/kv_rank.py) know the shared tiers without asking
  query   PrefixQuery -> PrefixQueryReply (longest prefix per holder and tier, broker tiers included)
  put     a chunked KV transfer of blocks (KVPayload with block_hashes) -> broker tiers
  get     BlockGet -> BlockGetReply, then the blocks as a KV transfer to the requester
  stats   -> BrokerStats
A holder that the balancer reports lost, or that stays silent for holder_ttl_s, is forgotten.
Blocks that fail their checksum (in a tier, or arriving in a put) are dropped and counted in
`moebus_kvbroker_kv_blocks_corrupt_total{tier=cpu|disk|transfer}`; a get serves only intact ones.
So are blocks that are not the one their key names (the checksum covers each block's hash and KV
fingerprint): a tier file moved to another key, or a put listing a block under another's hash. The
tiers hold every model's blocks (their hashes are namespaced); the worker checks the fingerprint.
A `Service` like the others (health, ready, heartbeats, ordered drain); errors are ServiceErrors.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from nats.aio.msg import Msg

from moebus.kv.index import PrefixIndex
from moebus.kv.payload import KVPayload, block_size_of
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.disk import DiskTier
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.tiers.tier import Tier
from moebus.kv.transports.nats import NatsKVTransport, NatsTransportConfig
from moebus.kv.transports.transport import KVTransferError
from moebus.shared.messages import (
    BROKER_HOLDER,
    BlockGet,
    BlockGetReply,
    BrokerStats,
    KVEvent,
    PrefixMatch,
    PrefixQuery,
    PrefixQueryReply,
    WorkerLost,
)
from moebus.shared.service import Empty, Service

from .config import KVBrokerConfig

log = logging.getLogger(__name__)


class KVBrokerService(Service):
    name = "kvbroker"

    def __init__(self, cfg: KVBrokerConfig, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: KVBrokerConfig = cfg
        self.index = PrefixIndex()
        self._m_corrupt = self.metrics.counter("kv_blocks_corrupt_total", "KV blocks dropped for failing their "
                                               "checksum, by where they were found", ["tier"])
        tiers: list[Tier] = [CpuTier(cfg.cpu_bytes, self._corrupt)]
        if cfg.disk_dir:
            tiers.append(DiskTier(cfg.disk_dir, cfg.disk_bytes, cfg.disk_fsync, self._corrupt))
        self._evicted: list[int] = []  # left every tier since our last event (store thread appends)
        self.store = TieredKVStore(tiers, on_evict=self._evicted.extend)
        self.counters = {"puts": 0, "gets": 0, "queries": 0}
        self._tcfg = NatsTransportConfig(chunk_bytes=cfg.chunk_bytes)
        self._receiver: NatsKVTransport | None = None
        self._sender: NatsKVTransport | None = None

    def broker_stats(self) -> BrokerStats:
        return BrokerStats(holders=self.index.holder_sizes(), tiers=self.store.stats(), **self.counters)

    def stats(self) -> dict[str, Any]:
        return self.broker_stats().model_dump()

    def _corrupt(self, tier: str, n: int = 1) -> None:
        self._m_corrupt.labels(tier).inc(n)

    # --- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        s, nc = self.subjects, self.bus.nc
        self._receiver = await NatsKVTransport(nc, s.kvbroker_put, self._tcfg, on_payload=self._on_put).start()
        self._sender = NatsKVTransport(nc, None, self._tcfg)
        # One at a time per subject, as events must apply in order (and the tiers are not shared).
        for subject, kind, handler in ((s.kvbroker_events, KVEvent, self._on_event),
                                       (s.kvbroker_query, PrefixQuery, self._on_query),
                                       (s.kvbroker_get, BlockGet, self._on_get),
                                       (s.kvbroker_stats, Empty, self._on_stats),
                                       (s.balancer_worker_lost, WorkerLost, self._on_worker_lost)):
            await self.bus.subscribe(subject, kind, handler, concurrent=False, endpoint=subject.split(".")[-1],
                                     traced=subject != s.kvbroker_events)  # events: one per worker tick
        self.spawn(self._expirer())
        log.info("kvbroker up on %s (%s)", self.cfg.nats_url, self.store.stats())

    async def teardown(self) -> None:
        if self._receiver is not None:
            await self._receiver.close()

    async def _expirer(self) -> None:
        last_snapshot = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.expire_interval_s)
            for holder in self.index.expire(time.monotonic(), self.cfg.holder_ttl_s):
                log.info("forgot silent KV holder %s", holder)
            if time.monotonic() - last_snapshot >= self.cfg.snapshot_s:
                last_snapshot = time.monotonic()
                await self._publish_tiers(snapshot=True)

    async def _publish_tiers(self, stored: Sequence[int] = (), snapshot: bool = False) -> None:
        """Our tiers' changes (or all they hold) as a holder's KVEvent, for the balancers' indexes."""
        n = len(self._evicted)  # (the store thread may append meanwhile: those go out next time)
        evicted = self._evicted[:n]
        del self._evicted[:n]
        if snapshot:
            stored = await asyncio.to_thread(self.store.keys)
        if stored or evicted or snapshot:
            await self.bus.publish(self.subjects.kvbroker_events,
                                   KVEvent(holder=BROKER_HOLDER, tier="cpu", stored=list(stored), evicted=evicted,
                                           snapshot=snapshot))

    # --- endpoints -------------------------------------------------------------------------
    async def _on_event(self, ev: KVEvent, _: Msg) -> None:
        if ev.holder != BROKER_HOLDER:  # (our own tiers answer for themselves: _on_query)
            self.index.apply(ev, time.monotonic())

    async def _on_worker_lost(self, lost: WorkerLost, _: Msg) -> None:
        self.index.remove_holder(lost.worker_id)

    async def _on_query(self, q: PrefixQuery, _: Msg) -> PrefixQueryReply:
        self.counters["queries"] += 1
        matches = self.index.longest_prefix(q.hashes, set(q.holders) if q.holders else None)
        n = self.store.longest_prefix(q.hashes)
        if n and (not q.holders or BROKER_HOLDER in q.holders):
            mine = PrefixMatch(holder=BROKER_HOLDER, tier=self.store.where(q.hashes[n - 1]) or "cpu", num_blocks=n)
            matches = sorted([*matches, mine], key=lambda m: (-m.num_blocks, m.holder, m.tier))
        return PrefixQueryReply(num_hashes=len(q.hashes), matches=matches)

    async def _on_get(self, req: BlockGet, _: Msg) -> BlockGetReply:
        self.counters["gets"] += 1
        blocks = await asyncio.to_thread(self.store.get_prefix, req.hashes)
        if blocks:
            payload = KVPayload.from_blocks(blocks, req.hashes[: len(blocks)], block_size_of(blocks))
            self.spawn(self._send(payload, req))
        return BlockGetReply(transfer_id=req.transfer_id, num_blocks=len(blocks))

    async def _send(self, payload: KVPayload, req: BlockGet) -> None:
        try:
            await self._sender.send(payload, req.reply_address, req.transfer_id)
        except KVTransferError as e:
            log.warning("could not deliver %s to %s: %s", req.transfer_id, req.reply_address, e)

    async def _on_put(self, transfer_id: str, payload: KVPayload) -> None:
        n = min(payload.num_blocks, len(payload.block_hashes))
        self.counters["puts"] += 1
        if payload.corrupt_blocks:  # decoding kept only the blocks before the first bad one
            self._corrupt("transfer", payload.corrupt_blocks)
            log.warning("put %s: %d KV blocks failed their checksum; stored the %d before the first", transfer_id,
                        payload.corrupt_blocks, n)

        def store() -> None:
            for i in range(n):
                self.store.put(payload.block_hashes[i], payload.block(i))
        await asyncio.to_thread(store)
        await self._publish_tiers(payload.block_hashes[:n])

    async def _on_stats(self, _: Empty, __: Msg) -> BrokerStats:
        return self.broker_stats()
