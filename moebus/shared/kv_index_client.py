"""Torch-free client of the KV broker's index, for workers (events) and balancers (queries).

Calls degrade instead of raising when the broker is gone (query -> None), so routing falls back
to plain load balancing. Import it from a worker or balancer as the broker's client library
(it never imports another service); tier put/get lives in tier_client (it needs torch).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Self

import nats.errors
from nats.aio.client import Client as NATS

from .codec import Message
from .kv_messages import (
    ERROR_HEADER,
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


class KVIndexClient:
    def __init__(self, nc: NATS, holder: str, subjects: KVSubjects = KVSubjects(), timeout_s: float = 2.0) -> None:
        """holder: this process's id in the broker index (the worker's instance id)."""
        self.nc, self.holder, self.subjects, self.timeout_s = nc, holder, subjects, timeout_s
        self._seq = 0

    async def start(self) -> Self:
        return self

    async def close(self) -> None:
        pass

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

    async def publish(self, stored: Iterable[int] = (), evicted: Iterable[int] = (), tier: TierName = "device",
                      snapshot: bool = False, cleared: bool = False) -> None:
        """Fire-and-forget; send a snapshot now and then (< holder_ttl_s) so lost events heal."""
        self._seq += 1
        ev = KVEvent(holder=self.holder, tier=tier, stored=list(stored), evicted=list(evicted),
                     snapshot=snapshot, cleared=cleared, seq=self._seq)
        await self.nc.publish(self.subjects.events, ev.encode())

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
