"""The transport interface: move one KVPayload from a sender to the receiver at `dest`.

A transfer is named by a transfer id the two sides agree on out of band (e.g. request id +
attempt, carried in the decode request); `address` is what a receiver advertises as `dest`.
NATS (any host) and shared memory (same host) implement it; an RDMA/NIXL transport would add
a third class with the same four methods.
"""
from __future__ import annotations

import abc
from typing import Self

from moebus.kv.payload import KVPayload


class KVTransferError(RuntimeError):
    """The payload did not arrive intact (no receiver, missing chunks, checksum mismatch)."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """Nothing (or not everything) arrived in time."""


class KVTransport(abc.ABC):
    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where senders reach this endpoint (`dest` of send)."""

    @abc.abstractmethod
    async def send(self, payload: KVPayload, dest: str, transfer_id: str) -> None:
        """Deliver payload to the receiver at dest; raises KVTransferError on failure."""

    @abc.abstractmethod
    async def receive(self, transfer_id: str, timeout: float = 30.0) -> KVPayload:
        """Wait for the named transfer; raises KVTransferTimeout / KVTransferError."""

    async def start(self) -> Self:
        return self

    async def close(self) -> None:  # noqa: B027  (optional hook)
        pass

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
