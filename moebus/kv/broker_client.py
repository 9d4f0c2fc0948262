"""Client side of the KV broker protocol (torch-free): what workers and balancers call.

`KVBrokerClient` publishes a holder's prefix-cache events, asks which holders have a prompt's
leading blocks, and moves blocks to and from the broker's shared tiers. Block data is opaque
here: it travels as a payload over a `BlockTransport` the caller passes in (kv.transports
satisfy it, with kv.payload.KVPayload), so this module never needs torch. Every call degrades instead of
raising when the broker is gone or answers with an error (query/stats -> None, put -> False,
get -> None): callers fall back to plain load balancing or recomputation.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from typing import Generic, Protocol, Self, TypeVar, runtime_checkable

from moebus.shared.bus import Bus
from moebus.shared.errors import ServiceError
from moebus.shared.messages.kvbroker import (
    BlockGet,
    BlockGetReply,
    BrokerStats,
    KVEvent,
    PrefixMatch,
    PrefixQuery,
    PrefixQueryReply,
    TierName,
)
from moebus.shared.service import Empty
from moebus.shared.subjects import Subjects

log = logging.getLogger(__name__)

# What a failed transfer raises: kv.transports.transport.KVTransferError (and KVTransferTimeout) are
# RuntimeErrors; shared memory fails with OSError; a torn payload with ValueError.
TRANSFER_ERRORS: tuple[type[Exception], ...] = (RuntimeError, OSError, ValueError)


@runtime_checkable
class BlockPayload(Protocol):
    """A KV payload of whole blocks named by their stable hashes (kv.payload.KVPayload)."""

    block_hashes: list[int]

    @property
    def num_blocks(self) -> int: ...


PayloadT = TypeVar("PayloadT", bound=BlockPayload)  # the payload type a transport moves


@runtime_checkable
class BlockTransport(Protocol[PayloadT]):
    """Moves one payload by transfer id (kv.transports.transport.KVTransport); raises TRANSFER_ERRORS."""

    @property
    def address(self) -> str: ...

    async def send(self, payload: PayloadT, dest: str, transfer_id: str) -> None: ...

    async def receive(self, transfer_id: str, timeout: float = 30.0) -> PayloadT: ...


class KVBrokerClient(Generic[PayloadT]):
    def __init__(self, bus: Bus, holder: str, subjects: Subjects = Subjects(), timeout_s: float = 2.0,
                 transport: BlockTransport[PayloadT] | None = None) -> None:
        """holder: this process's id in the broker index (a worker's instance id);
        transport: where get replies arrive and puts leave from (needed only for put/get)."""
        self.bus, self.holder, self.subjects, self.timeout_s = bus, holder, subjects, timeout_s
        self.transport = transport
        self._seq = 0

    async def start(self) -> Self:
        return self

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- index -----------------------------------------------------------------------------
    async def publish(self, stored: Iterable[int] = (), evicted: Iterable[int] = (), tier: TierName = "device",
                      snapshot: bool = False, cleared: bool = False) -> None:
        """Fire-and-forget; send a snapshot now and then (< holder_ttl_s) so lost events heal."""
        self._seq += 1
        ev = KVEvent(holder=self.holder, tier=tier, stored=list(stored), evicted=list(evicted),
                     snapshot=snapshot, cleared=cleared, seq=self._seq)
        await self.bus.publish(self.subjects.kvbroker_events, ev)

    async def query(self, hashes: list[int], holders: Iterable[str] = ()) -> list[PrefixMatch] | None:
        """Longest prefix per (holder, tier), best first; None when the broker is unreachable."""
        try:
            reply = await self.bus.request(self.subjects.kvbroker_query,
                                           PrefixQuery(hashes=hashes, holders=list(holders)), PrefixQueryReply,
                                           self.timeout_s)
        except ServiceError as e:
            log.warning("prefix query failed: %s", e)
            return None
        return reply.matches

    async def stats(self) -> BrokerStats | None:
        try:
            return await self.bus.request(self.subjects.kvbroker_stats, Empty(), BrokerStats, self.timeout_s)
        except ServiceError:
            return None

    # ---- shared tiers ----------------------------------------------------------------------
    async def put(self, payload: PayloadT) -> bool:
        """Offload a payload of blocks to the broker's tiers; True once it has stored them."""
        if not payload.num_blocks:
            return True
        try:
            await self._transport().send(payload, self.subjects.kvbroker_put, f"put-{self.holder}-{uuid.uuid4().hex}")
            return True
        except TRANSFER_ERRORS as e:
            log.warning("offload to the KV broker failed: %s", e)
            return False

    async def get(self, hashes: list[int], timeout: float | None = None) -> PayloadT | None:
        """A payload of the leading run of `hashes` the broker's tiers hold (None: nothing, or
        any failure)."""
        if not hashes:
            return None
        transport, tid = self._transport(), f"get-{self.holder}-{uuid.uuid4().hex}"
        timeout = timeout or self.timeout_s
        try:
            reply = await self.bus.request(self.subjects.kvbroker_get,
                                           BlockGet(hashes=hashes, reply_address=transport.address, transfer_id=tid),
                                           BlockGetReply, timeout)
            if not reply.num_blocks:
                return None
            payload = await transport.receive(tid, timeout)
        except (ServiceError, *TRANSFER_ERRORS) as e:
            log.warning("fetch from the KV broker failed: %s", e)
            return None
        if list(payload.block_hashes) != hashes[: payload.num_blocks]:
            log.warning("KV broker sent blocks for other hashes; ignoring them")
            return None
        return payload

    def _transport(self) -> BlockTransport[PayloadT]:
        if self.transport is None:
            raise RuntimeError("KVBrokerClient needs a transport for the broker's tiers")
        return self.transport
