"""KV transfer through POSIX shared memory, for a prefill and a decode worker on one host.

The sender writes the payload's encoding into a segment named after (receiver address,
transfer id) and flips a ready flag last; the receiver polls for the segment, checks the
CRC-32, copies the tensors out and unlinks it. One copy on each side, no socket traffic.
"""
from __future__ import annotations

import asyncio
import hashlib
import struct
import time
import zlib
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

from moebus.kv.payload import KVPayload
from moebus.kv.transports.transport import KVTransferError, KVTransferTimeout, KVTransport

_HDR = struct.Struct("<IIQI")  # magic, ready flag, body bytes, crc32
_HDR_SIZE = 64
_MAGIC = 0x4D42534B


@dataclass(slots=True)
class ShmTransportConfig:
    address: str = "moebus-kv"  # this endpoint's segment name prefix (unique per receiver)
    poll_s: float = 0.002
    verify: bool = True  # CRC-32 the whole body; off, the payload's own header and per-block checks still run
    ttl_s: float = 60.0  # the sender unlinks segments nobody claimed after this


def segment_name(dest: str, transfer_id: str) -> str:
    return f"{dest}-{hashlib.blake2b(transfer_id.encode(), digest_size=12).hexdigest()}"


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # Python < 3.13 registers every segment with the resource tracker, which would unlink it
    # when this process exits; the receiver owns the segment's lifetime instead.
    resource_tracker.unregister(shm._name, "shared_memory")


class ShmKVTransport(KVTransport):
    def __init__(self, config: ShmTransportConfig | None = None) -> None:
        self.config = config or ShmTransportConfig()
        self._sent: dict[str, float] = {}  # segment name -> created at

    @property
    def address(self) -> str:
        return self.config.address

    async def send(self, payload: KVPayload, dest: str, transfer_id: str) -> None:
        self._sweep(time.monotonic() - self.config.ttl_s)
        packed = payload.packed()
        name = segment_name(dest, transfer_id)
        try:
            shm = shared_memory.SharedMemory(name, create=True, size=_HDR_SIZE + packed.nbytes)
        except FileExistsError as e:
            raise KVTransferError(f"transfer {transfer_id} to {dest} already exists") from e
        _untrack(shm)
        try:
            body = shm.buf[_HDR_SIZE:_HDR_SIZE + packed.nbytes]
            packed.write_into(body)
            crc = zlib.crc32(body) if self.config.verify else 0
            body.release()
            _HDR.pack_into(shm.buf, 0, _MAGIC, 0, packed.nbytes, crc)
            struct.pack_into("<I", shm.buf, 4, 1)  # ready: written after the data
        finally:
            shm.close()
        self._sent[name] = time.monotonic()

    async def receive(self, transfer_id: str, timeout: float = 30.0) -> KVPayload:
        name = segment_name(self.address, transfer_id)
        deadline = time.monotonic() + timeout
        shm: shared_memory.SharedMemory | None = None
        try:
            while True:
                if shm is None:
                    try:
                        shm = shared_memory.SharedMemory(name)
                    except (FileNotFoundError, ValueError):  # not there yet / not yet sized
                        shm = None
                if shm is not None and shm.size >= _HDR_SIZE and struct.unpack_from("<I", shm.buf, 4)[0] == 1:
                    break
                if time.monotonic() > deadline:
                    raise KVTransferTimeout(f"{transfer_id} did not arrive within {timeout}s")
                await asyncio.sleep(self.config.poll_s)
            magic, _, nbytes, crc = _HDR.unpack_from(shm.buf, 0)
            body = shm.buf[_HDR_SIZE:_HDR_SIZE + nbytes]
            try:
                if magic != _MAGIC or (self.config.verify and zlib.crc32(body) != crc):
                    raise KVTransferError(f"{transfer_id}: corrupt shared-memory segment")
                try:
                    return KVPayload.from_bytes(body)
                except ValueError as e:  # torn, another format version (KVVersionError): recomputed
                    why = str(e)
                # raised outside the handler: a chained traceback would keep views of the segment
                # alive, and closing it would fail (BufferError)
                raise KVTransferError(f"{transfer_id}: undecodable payload: {why}")
            finally:
                body.release()
        finally:
            if shm is not None:
                shm.close()
                shm.unlink()  # also unregisters it from this process's resource tracker

    def _sweep(self, cutoff: float) -> None:
        for name in [n for n, t in self._sent.items() if t < cutoff]:
            del self._sent[name]
            _unlink(name)

    async def close(self) -> None:
        """Unlink segments this sender wrote that no receiver claimed."""
        self._sweep(float("inf"))


def _unlink(name: str) -> None:
    try:
        shm = shared_memory.SharedMemory(name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()
