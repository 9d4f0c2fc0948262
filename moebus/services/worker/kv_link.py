"""Asyncio side of a worker's KV features: the transports of a prefill/decode split, the KV
broker's index (events) and shared tiers (put/get). Every broker call degrades (None / [] /
False): a dead broker or tier only means recomputing, never a lost request. What the broker's
tiers hold is known here from its own KV events (as the balancers know it), so a fetch asks the
broker only for blocks it has. The broker protocol itself is kv.broker_client (torch-free);
kv.block_client.KVBlockClient moves the blocks.

KV moves on a NATS connection of its own (`kv_bus`), not the service's: bulk bytes never queue
behind or ahead of heartbeats, hand-offs and token chunks, and a KV stall can cost no control
message. Every NATS transfer to this worker draws on one credit pool of cfg.kv_credit_bytes
(kv/transports/credit.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from moebus.kv.block_client import KVBlockClient
from moebus.kv.broker_client import KVBrokerClient
from moebus.kv.hashing import kv_fingerprint
from moebus.kv.index import PrefixIndex
from moebus.kv.payload import KVPayload
from moebus.kv.transports.nats import NatsKVTransport, NatsTransportConfig
from moebus.kv.transports.shm import ShmKVTransport, ShmTransportConfig
from moebus.kv.transports.transport import KVTransferError, KVTransport
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages import BROKER_HOLDER, GenerateRequest, HandoffBeat, KVEvent, KVTransferSpec
from moebus.shared.metrics import Metrics
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .config import WorkerConfig
from .engine_loop import EngineLoop
from .kv_engine import EngineKV

log = logging.getLogger(__name__)


class WorkerKVLink:
    def __init__(self, cfg: WorkerConfig, nc: NATS, instance_id: str, loop: EngineLoop, kv: EngineKV,
                 on_corrupt: Callable[[int], None] | None = None, metrics: Metrics | None = None,
                 tracing: Tracing | None = None) -> None:
        """on_corrupt(n): n blocks that arrived (transfer or broker) failed their checksum;
        metrics: where KV transfer bytes and seconds (by direction: send, receive) are counted."""
        self.cfg, self.nc, self.instance_id, self.loop, self.kv = cfg, nc, instance_id, loop, kv
        self.on_corrupt = on_corrupt
        self.subjects = Subjects(cfg.subject_prefix)
        self.bus = Bus(nc, tracing or Tracing("worker"))  # typed requests and trace headers on the service's connection
        self.kv_bus: Bus | None = None  # the connection KV bytes move on (start)
        self.receiver: KVTransport | None = None
        self._senders: dict[str, KVTransport] = {}
        self.index: KVBrokerClient | None = None
        self.broker: KVBlockClient | None = None
        self.shared = PrefixIndex()  # the broker's tiers only (holder BROKER_HOLDER), from its KV events
        self._m_bytes = metrics.counter("kv_transfer_bytes_total", "KV bytes moved between prefill and decode "
                                        "workers", ["direction"]) if metrics else None
        self._m_seconds = metrics.histogram("kv_transfer_seconds", "KV transfer time (receive: from waiting for "
                                            "it to its arrival)", ["direction"]) if metrics else None
        if self._m_bytes is not None:  # exported from the start: an aggregated stack's transfer rate reads 0
            for direction in ("send", "receive"):
                self._m_bytes.labels(direction)
        self.counters = {"kv_sent": 0, "kv_send_failed": 0, "kv_received": 0, "kv_receive_failed": 0,
                         "tier_fetched_blocks": 0, "tier_shared_blocks": 0,
                         "tier_fetch_skipped": 0,  # prompts missing blocks the broker was not known to hold: no get
                         "kv_corrupt_blocks": 0}  # failed their checksum on arrival: dropped, recomputed

    def transport_config(self) -> NatsTransportConfig:
        credit = self.cfg.kv_credit_bytes
        return NatsTransportConfig(credit_bytes=credit, grant_bytes=min(4 * 1024 * 1024, credit))

    async def start(self) -> None:
        # Same servers and credentials (its bus user is this instance's) as the service's connection.
        servers = [s.strip() for s in self.cfg.nats_url.split(",") if s.strip()]
        self.kv_bus = await Bus.connect(BusConfig(servers=servers, name=self.instance_id), Tracing("worker"))
        if self.cfg.role != "prefill":  # decode workers (and "both", as spare decoders) receive KV
            if self.cfg.kv_transport == "shm":
                self.receiver = ShmKVTransport(ShmTransportConfig(address=f"moebus-kv-{self.instance_id}"))
            else:
                self.receiver = await NatsKVTransport(self.kv_bus.nc, self.subjects.kvtransfer_push(self.instance_id),
                                                      self.transport_config()).start()
        if self.cfg.kv_events:
            self.index = KVBrokerClient(self.bus, self.instance_id, self.subjects)
        if self.cfg.kv_share and self.kv.store is not None:
            self.broker = await KVBlockClient(self.bus, self.instance_id, self.subjects, on_corrupt=self._corrupt,
                                              kv_nc=self.kv_bus.nc, credit_bytes=self.cfg.kv_credit_bytes).start()
            # (in order, as the balancer's; one per holder tick: untraced)
            await self.bus.subscribe(self.subjects.kvbroker_events, KVEvent, self._on_kv_event, concurrent=False,
                                     traced=False, endpoint="kv_events")

    async def close(self) -> None:
        for t in (self.receiver, self.broker, *self._senders.values()):
            if t is not None:
                try:
                    await t.close()
                except Exception:
                    log.debug("closing a KV transport failed", exc_info=True)
        if self.kv_bus is not None:
            self.kv_bus.closing = True
            await self.kv_bus.nc.close()

    @property
    def address(self) -> str | None:
        return self.receiver.address if self.receiver is not None else None

    @property
    def transport_kind(self) -> str:
        return self.cfg.kv_transport

    # ---- prefill -> decode -----------------------------------------------------------------
    def _sender(self, kind: str) -> KVTransport:
        if kind not in self._senders:
            self._senders[kind] = (ShmKVTransport() if kind == "shm" else
                                   NatsKVTransport(self.kv_bus.nc if self.kv_bus else self.nc, None))
        return self._senders[kind]

    async def send(self, payload: KVPayload | None, spec: KVTransferSpec) -> bool:
        if payload is None:
            return False
        kind = "nats" if spec.address.startswith(self.subjects.prefix + ".") else "shm"
        started = time.monotonic()
        try:
            await self._sender(kind).send(payload, spec.address, spec.transfer_id)
        except (KVTransferError, OSError) as e:
            log.warning("KV transfer %s to %s failed: %s (the decode worker recomputes)", spec.transfer_id,
                        spec.decode_worker, e)
            self.counters["kv_send_failed"] += 1
            return False
        self.counters["kv_sent"] += 1
        self._observe("send", payload, started)
        return True

    async def beat(self, decode_worker: str, transfer_ids: list[str]) -> None:
        """Tell a decode worker which of its split requests this (prefill) worker still holds."""
        await self.bus.publish(self.subjects.worker_handoff_beat(decode_worker),
                               HandoffBeat(worker_id=self.instance_id, transfer_ids=transfer_ids))

    def _observe(self, direction: str, payload: KVPayload, started: float) -> None:
        if self._m_bytes is not None:
            self._m_bytes.labels(direction).inc(payload.nbytes)
            self._m_seconds.labels(direction).observe(time.monotonic() - started)

    async def receive(self, transfer_id: str, timeout: float) -> KVPayload | None:
        if self.receiver is None:
            return None
        started = time.monotonic()
        try:
            payload = await self.receiver.receive(transfer_id, timeout)
        except (KVTransferError, OSError) as e:
            log.warning("KV transfer %s did not arrive: %s (recomputing)", transfer_id, e)
            self.counters["kv_receive_failed"] += 1
            return None
        self.counters["kv_received"] += 1
        self._observe("receive", payload, started)
        if payload.corrupt_blocks:  # only the blocks before the first bad one remain: the rest is recomputed
            log.warning("KV transfer %s: %d blocks failed their checksum (recomputing them)", transfer_id,
                        payload.corrupt_blocks)
            self._corrupt(payload.corrupt_blocks)
        return payload

    def _corrupt(self, n: int) -> None:
        self.counters["kv_corrupt_blocks"] += n
        if self.on_corrupt is not None:
            self.on_corrupt(n)

    # ---- shared tiers and the index ---------------------------------------------------------
    async def fetch(self, req: GenerateRequest) -> int:
        """Before queueing: copy the prompt's blocks the broker's tiers hold (beyond what this
        worker has) into the local store, where load_prefix finds them after add_request. The
        block hashes are the request's own (hashed once, by its frontend) where they fit our KV."""
        if self.broker is None or not self.kv.block_size:
            return 0
        n = (len(req.prompt_token_ids) - 1) // self.kv.block_size  # the last token always runs
        hashes = req.block_hashes_in(self.kv.block_size, self.kv.namespace)[:n]
        have = await self.loop.call(lambda e: self.kv.local_prefix(e, hashes))
        if have >= len(hashes):
            return 0
        want = hashes[have:have + self.broker_run(hashes[have:])]
        if not want:  # the broker is not known to hold the next block: a get would bring nothing
            self.counters["tier_fetch_skipped"] += 1
            return 0
        blocks = await self.broker.get_blocks(want, fingerprint=kv_fingerprint(self.kv.namespace))
        if not blocks:
            return 0
        got = await self.loop.call(lambda e: self.kv.put_local(e, want, blocks))
        self.counters["tier_fetched_blocks"] += got
        return got

    def broker_run(self, hashes: list[int]) -> int:
        """How many leading `hashes` the broker's tiers hold, as far as its KV events told us.
        Stale at worst by lost events, and both ways only cost time: a block stored since is
        missed (its tokens recomputed, the same ones), one dropped since makes the get return
        fewer blocks (fetch takes what came). A started worker knows them from the broker's next
        event or snapshot; a silent broker (kv_broker_ttl_s) is asked nothing."""
        self.shared.expire(time.monotonic(), self.cfg.kv_broker_ttl_s)
        # (the broker reports all its tiers as one, so the best tier's run is its whole run)
        return max((m.num_blocks for m in self.shared.longest_prefix(hashes, {BROKER_HOLDER})), default=0)

    async def _on_kv_event(self, ev: KVEvent, _: Msg) -> None:
        if ev.holder == BROKER_HOLDER:  # (workers' events are the balancers' business)
            self.shared.apply(ev, time.monotonic())

    async def run(self, interval_s: float) -> None:
        """Background: publish cache events every interval (a snapshot every kv_snapshot_s) and
        hand newly offloaded blocks to the broker's tiers."""
        last_snapshot = 0.0
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._tick(snapshot=time.monotonic() - last_snapshot >= self.cfg.kv_snapshot_s)
                if time.monotonic() - last_snapshot >= self.cfg.kv_snapshot_s:
                    last_snapshot = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:  # the broker is optional: never let its trouble stop this loop
                log.warning("KV event/offload tick failed", exc_info=True)

    async def _tick(self, snapshot: bool) -> None:
        if not self.nc.is_connected or self.loop.failed is not None or not self.loop.ready.is_set():
            return
        if self.index is not None:
            polled: dict[str, Any] = await self.loop.call(self.kv.poll)
            if snapshot:
                for tier, held in (await self.loop.call(self.kv.held)).items():
                    await self.index.publish(held, tier=tier, snapshot=True)
            else:
                for tier, (stored, evicted) in polled.items():
                    if stored or evicted:
                        await self.index.publish(stored, evicted, tier=tier)
        if self.broker is not None:
            hashes, blocks = await self.loop.call(self.kv.take_fresh)
            if hashes and await self.broker.put_blocks(hashes, blocks):
                self.counters["tier_shared_blocks"] += len(hashes)
