"""KV transfer over NATS: the payload's encoding in ordered chunks, reassembled by transfer id.

Every `window`-th chunk (and the last) is a request the receiver acks, which bounds the bytes
in flight (no slow-consumer drops) and reports missing chunks; the last chunk carries the
CRC-32 of the whole encoding, checked before decoding. Works across hosts; one NATS message
per chunk, so chunk_bytes stays below the server's max_payload.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Self

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from moebus.engine.kv_transfer.payload import KVPayload
from moebus.kvtransport.base import KVTransferError, KVTransferTimeout, KVTransport

log = logging.getLogger(__name__)
H_ID, H_SEQ, H_TOTAL, H_BYTES, H_CRC = ("Moebus-Kv-Id", "Moebus-Kv-Seq", "Moebus-Kv-Total", "Moebus-Kv-Bytes",
                                        "Moebus-Kv-Crc")


@dataclass(slots=True)
class NatsTransportConfig:
    chunk_bytes: int = 512 * 1024  # capped by the server's max_payload
    window: int = 16  # chunks per acked round trip (bounds bytes in flight)
    ack_timeout_s: float = 10.0
    ttl_s: float = 60.0  # partial or unclaimed transfers are dropped after this
    pending_bytes_limit: int = 512 * 1024 * 1024  # receiver subscription buffer

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1024 or self.window < 1:
            raise ValueError("chunk_bytes must be >= 1024 and window >= 1")


@dataclass(slots=True)
class _Assembly:
    total: int
    nbytes: int
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)
    crc: int | None = None


@dataclass(slots=True)
class _Done:
    at: float
    payload: KVPayload | None = None
    error: str = ""


class NatsKVTransport(KVTransport):
    """`subject` is this endpoint's receive address (e.g. ``moebus.v1.kvtransfer.push.<worker>``);
    a send-only endpoint may pass None. With `on_payload`, every completed transfer is handed to
    it (awaited before the final ack, so a returned send means it was handled) instead of
    waiting for receive()."""

    def __init__(self, nc: NATS, subject: str | None, config: NatsTransportConfig | None = None,
                 on_payload: Callable[[str, KVPayload], Awaitable[None]] | None = None) -> None:
        self.nc, self.subject = nc, subject
        self.config = config or NatsTransportConfig()
        self.on_payload = on_payload
        self._sub: Subscription | None = None
        self._partial: dict[str, _Assembly] = {}
        self._done: dict[str, _Done] = {}
        self._waiters: dict[str, asyncio.Future[None]] = {}

    @property
    def address(self) -> str:
        if self.subject is None:
            raise RuntimeError("a send-only transport has no address")
        return self.subject

    async def start(self) -> Self:
        if self.subject is not None and self._sub is None:
            self._sub = await self.nc.subscribe(self.subject, cb=self._on_chunk,
                                                pending_bytes_limit=self.config.pending_bytes_limit)
            await self.nc.flush()
        return self

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for fut in self._waiters.values():
            fut.cancel()

    # --- sender ----------------------------------------------------------------------------
    def chunk_size(self) -> int:
        return max(1024, min(self.config.chunk_bytes, self.nc.max_payload - 4096))

    async def send(self, payload: KVPayload, dest: str, transfer_id: str) -> None:
        await self.send_bytes(payload.to_bytes(), dest, transfer_id)

    async def send_bytes(self, body: bytes | bytearray, dest: str, transfer_id: str) -> None:
        size, cfg = self.chunk_size(), self.config
        mv = memoryview(body)
        total = max(1, -(-len(mv) // size))
        base = {H_ID: transfer_id, H_TOTAL: str(total), H_BYTES: str(len(mv))}
        for seq in range(total):
            data = bytes(mv[seq * size:(seq + 1) * size])
            hdr = {**base, H_SEQ: str(seq)}
            last = seq == total - 1
            if last:
                hdr[H_CRC] = str(zlib.crc32(mv))
            if not last and (seq + 1) % cfg.window:
                await self.nc.publish(dest, data, headers=hdr)
                continue
            try:
                reply = await self.nc.request(dest, data, timeout=cfg.ack_timeout_s, headers=hdr)
            except nats.errors.NoRespondersError as e:
                raise KVTransferError(f"no KV receiver on {dest}") from e
            except (TimeoutError, nats.errors.TimeoutError) as e:
                raise KVTransferTimeout(f"{transfer_id}: no ack from {dest} for chunk {seq}") from e
            ack = json.loads(reply.data or b"{}")
            if not ack.get("ok"):
                raise KVTransferError(f"{transfer_id}: receiver refused chunk {seq}: {ack.get('error')}")

    # --- receiver --------------------------------------------------------------------------
    async def receive(self, transfer_id: str, timeout: float = 30.0) -> KVPayload:
        if transfer_id not in self._done:
            fut = self._waiters.setdefault(transfer_id, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError as e:
                raise KVTransferTimeout(f"{transfer_id} did not arrive within {timeout}s") from e
            finally:
                self._waiters.pop(transfer_id, None)
        done = self._done.pop(transfer_id)
        if done.payload is None:
            raise KVTransferError(f"{transfer_id}: {done.error}")
        return done.payload

    async def _on_chunk(self, msg: Msg) -> None:
        h = msg.headers or {}
        tid, error = h.get(H_ID), ""
        self._expire()
        try:
            if tid is None:
                raise ValueError("chunk without a transfer id")
            seq, total, nbytes = int(h[H_SEQ]), int(h[H_TOTAL]), int(h[H_BYTES])
            if tid in self._done:
                error = self._done[tid].error  # a duplicate of a finished transfer
            else:
                asm = self._partial.setdefault(tid, _Assembly(total, nbytes, time.monotonic()))
                asm.parts[seq] = msg.data
                if H_CRC in h:
                    asm.crc = int(h[H_CRC])
                if asm.crc is not None and len(asm.parts) == asm.total:
                    error = await self._complete(tid, self._partial.pop(tid))
                elif msg.reply and len(asm.parts) != seq + 1:
                    error = f"missing chunks: have {len(asm.parts)} of the first {seq + 1}"
                    del self._partial[tid]  # the sender gives up; a retry starts clean
        except (KeyError, ValueError) as e:
            error = f"bad chunk: {e}"
        if msg.reply:
            await msg.respond(json.dumps({"ok": not error, "error": error}).encode())

    async def _complete(self, tid: str, asm: _Assembly) -> str:
        body = b"".join(asm.parts[i] for i in range(asm.total))
        done = _Done(time.monotonic())
        if len(body) != asm.nbytes or zlib.crc32(body) != asm.crc:
            done.error = "size or checksum mismatch"
        else:
            try:
                done.payload = KVPayload.from_bytes(body)
            except ValueError as e:
                done.error = f"undecodable payload: {e}"
        if self.on_payload is not None:
            if done.payload is not None:
                try:
                    await self.on_payload(tid, done.payload)
                except Exception as e:  # reported to the sender as a refused transfer
                    log.exception("KV payload handler failed for %s", tid)
                    done.error = f"handler failed: {e}"
            return done.error
        self._done[tid] = done
        fut = self._waiters.get(tid)
        if fut is not None and not fut.done():
            fut.set_result(None)
        return done.error

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.config.ttl_s
        for tid in [t for t, a in self._partial.items() if a.started < cutoff]:
            log.warning("dropping incomplete KV transfer %s", tid)
            del self._partial[tid]
        for tid in [t for t, d in self._done.items() if d.at < cutoff and t not in self._waiters]:
            del self._done[tid]
